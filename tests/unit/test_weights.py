"""engines.memory.weights: the host RAM an engine's weights take at Level 1, from the roster or its checkpoint files.

Checkpoints here are sparse files: any apparent size, no disk used.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from config.schema import ModelSpec
from engines.memory.weights import weights_gb

HF_VARS = ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HOME", "XDG_CACHE_HOME")


@pytest.fixture(autouse=True)
def clean_env(monkeypatch, tmp_path: Path):
    """No Hugging Face variable from the machine running the tests; HOME is a fresh directory."""
    for name in HF_VARS:
        monkeypatch.delenv(name, raising=False)
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(tmp_path)


def sparse(path: Path, size: int) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.touch()
    os.truncate(path, size)
    return path


def checkpoint(folder: Path, files: dict[str, int]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for name, size in files.items():
        sparse(folder / name, size)
    (folder / "config.json").write_text("{}")
    return folder


def hub_snapshot(cache: Path, repo_id: str, commit: str, files: dict[str, int], *, main: bool = False) -> Path:
    """The huggingface_hub layout: snapshot files are relative links to blobs named by their hash."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    for name, size in files.items():
        blob = sparse(repo / "blobs" / f"{commit}-{name}-sha", size)
        (snapshot / name).symlink_to(os.path.relpath(blob, snapshot))
    if main:
        (repo / "refs").mkdir(exist_ok=True)
        (repo / "refs" / "main").write_text(commit)
    return snapshot


def spec(**fields) -> ModelSpec:
    return ModelSpec(name=fields.pop("name", "m"), **fields)


# -- the roster's number, and engines the router cannot look into ---------------------------

def test_weights_gb_in_the_roster_wins_over_the_files(tmp_path: Path):
    folder = checkpoint(tmp_path / "ckpt", {"model.safetensors": 8 * 10**9})
    assert weights_gb(spec(model=str(folder), weights_gb=27.5)) == (27.5, "weights_gb: 27.5 in the roster")


def test_command_and_url_engines_are_unknown_and_say_so():
    assert weights_gb(spec(command=["my-engine", "--port", "{port}"])) == (
        None, "model 'm' runs a `command`, so the router cannot see its checkpoint; set weights_gb")
    assert weights_gb(spec(url="http://10.0.0.5:8000")) == (
        None, "model 'm' is attached by url (http://10.0.0.5:8000), so the router cannot see its checkpoint; set weights_gb")


# -- a local directory ----------------------------------------------------------------------

def test_a_local_checkpoint_is_the_sum_of_its_weight_files(tmp_path: Path):
    folder = checkpoint(tmp_path / "llama-70b", {
        "model-00001-of-00002.safetensors": 100 * 10**9, "model-00002-of-00002.safetensors": 41 * 10**9,
        "tokenizer.json": 5 * 10**6,
    })
    sparse(folder / "original" / "consolidated.00.safetensors", 141 * 10**9)  # a subfolder vLLM does not load
    assert weights_gb(spec(model=str(folder))) == (141.0, f"141.00 GB in 2 *.safetensors files in {folder}")


def test_safetensors_win_over_bin_and_bin_over_pt_as_vllm_loads_them(tmp_path: Path):
    both = checkpoint(tmp_path / "both", {"model.safetensors": 3 * 10**9, "pytorch_model.bin": 3 * 10**9, "extra.pt": 10**9})
    assert weights_gb(spec(model=str(both)))[0] == 3.0
    bins = checkpoint(tmp_path / "bins", {"pytorch_model.bin": 2 * 10**9, "training_args.bin": 10**9, "optimizer.pt": 10**9})
    assert weights_gb(spec(model=str(bins))) == (2.0, f"2.00 GB in 1 *.bin file in {bins}")
    pts = checkpoint(tmp_path / "pts", {"model.pt": 10**9, "scheduler.pt": 10**9})
    assert weights_gb(spec(model=str(pts))) == (1.0, f"1.00 GB in 1 *.pt file in {pts}")


def test_the_safetensors_index_leaves_out_a_duplicate_checkpoint(tmp_path: Path):
    folder = checkpoint(tmp_path / "ckpt", {"model-00001-of-00002.safetensors": 4 * 10**9, "model-00002-of-00002.safetensors": 10**9,
                                            "extra-copy.safetensors": 5 * 10**9})
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
        "a.weight": "model-00001-of-00002.safetensors", "b.weight": "model-00002-of-00002.safetensors"}}))
    assert weights_gb(spec(model=str(folder)))[0] == 5.0


def test_a_mistral_repo_counts_its_consolidated_file_once(tmp_path: Path):
    folder = checkpoint(tmp_path / "mistral", {"consolidated.safetensors": 14 * 10**9, "model-00001-of-00003.safetensors": 5 * 10**9,
                                               "model-00002-of-00003.safetensors": 5 * 10**9, "model-00003-of-00003.safetensors": 4 * 10**9})
    assert weights_gb(spec(model=str(folder))) == (14.0, f"14.00 GB in 1 consolidated*.safetensors file in {folder}")


def test_a_directory_without_weight_files_is_unknown(tmp_path: Path):
    folder = checkpoint(tmp_path / "gguf", {"model-q4.gguf": 4 * 10**9})
    assert weights_gb(spec(model=str(folder))) == (
        None, f"no weight files (*.safetensors, *.bin, *.pt) in {folder}; set weights_gb")


def test_a_path_that_is_not_there_is_unknown(tmp_path: Path):
    assert weights_gb(spec(model=str(tmp_path / "nowhere"))) == (
        None, f"model '{tmp_path / 'nowhere'}' is not a local directory (nor a Hugging Face id); set weights_gb")


# -- the Hugging Face cache -----------------------------------------------------------------

def test_a_hub_id_is_read_from_the_snapshot_refs_main_names_following_its_links(monkeypatch, tmp_path: Path):
    cache = tmp_path / "hf-cache"
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    main = hub_snapshot(cache, "meta-llama/Llama-3.1-8B-Instruct", "aaa111", {"model-1.safetensors": 10 * 10**9, "model-2.safetensors": 6 * 10**9}, main=True)
    newer = hub_snapshot(cache, "meta-llama/Llama-3.1-8B-Instruct", "bbb222", {"model.safetensors": 99 * 10**9})
    os.utime(newer, (2e9, 2e9))  # newer than main's snapshot, and still not the one main names
    assert weights_gb(spec(model="meta-llama/Llama-3.1-8B-Instruct")) == (
        16.0, f"16.00 GB in 2 *.safetensors files in the Hugging Face cache ({main})")


def test_without_refs_main_the_newest_snapshot(monkeypatch, tmp_path: Path):
    cache = tmp_path / "hf-cache"
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    old = hub_snapshot(cache, "org/model", "old", {"model.safetensors": 1 * 10**9})
    new = hub_snapshot(cache, "org/model", "new", {"model.safetensors": 2 * 10**9})
    os.utime(old, (1e9, 1e9))
    os.utime(new, (2e9, 2e9))
    assert weights_gb(spec(model="org/model"))[0] == 2.0


def test_revision_and_download_dir_in_args_are_where_vllm_looks(monkeypatch, tmp_path: Path):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "elsewhere"))
    cache = tmp_path / "downloads"
    hub_snapshot(cache, "org/model", "c0ffee", {"model.safetensors": 1 * 10**9}, main=True)
    hub_snapshot(cache, "org/model", "beef00", {"model.safetensors": 3 * 10**9})
    (cache / "models--org--model" / "refs" / "v2").write_text("beef00")
    args = ["--download-dir", str(cache)]
    assert weights_gb(spec(model="org/model", args=args))[0] == 1.0
    assert weights_gb(spec(model="org/model", args=[*args, "--revision", "v2"]))[0] == 3.0
    assert weights_gb(spec(model="org/model", args=[*args, "--revision=c0ffee"]))[0] == 1.0
    assert weights_gb(spec(model="org/model", args=[*args, "--revision", "v9"])) == (
        None, f"model 'org/model' is neither a local directory nor revision 'v9' in the Hugging Face cache at {cache}; set weights_gb")


def test_a_hub_id_not_in_the_cache_is_unknown_and_names_the_cache(monkeypatch, tmp_path: Path):
    cache = tmp_path / "hf-cache"
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    assert weights_gb(spec(model="org/absent")) == (
        None, f"model 'org/absent' is neither a local directory nor in the Hugging Face cache at {cache}; set weights_gb")


def test_a_snapshot_with_a_broken_link_is_unknown(monkeypatch, tmp_path: Path):
    cache = tmp_path / "hf-cache"
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    snapshot = hub_snapshot(cache, "org/model", "abc", {"model.safetensors": 10**9}, main=True)
    (snapshot / "model.safetensors").resolve().unlink()
    assert weights_gb(spec(model="org/model")) == (
        None, f"{snapshot / 'model.safetensors'} cannot be read (a broken link: an interrupted download?); set weights_gb")


@pytest.mark.parametrize(("router_env", "engine_env", "cache"), [
    pytest.param({}, {}, "home/.cache/huggingface/hub", id="default-under-home"),
    pytest.param({"XDG_CACHE_HOME": "xdg"}, {}, "xdg/huggingface/hub", id="xdg"),
    pytest.param({"HF_HOME": "router-home"}, {}, "router-home/hub", id="router-hf-home"),
    pytest.param({"HF_HOME": "router-home"}, {"HF_HOME": "engine-home"}, "engine-home/hub", id="engine-hf-home-wins"),
    pytest.param({"HF_HUB_CACHE": "router-cache"}, {"HF_HUB_CACHE": "engine-cache"}, "engine-cache", id="engine-hub-cache-wins"),
    pytest.param({"HF_HUB_CACHE": "router-cache"}, {"HF_HOME": "engine-home"}, "router-cache",
                 id="hub-cache-beats-hf-home-as-in-the-engine-process"),
    pytest.param({}, {"HF_HOME": "~/hf"}, "home/hf/hub", id="tilde-is-home"),
])
def test_the_cache_is_where_the_engine_process_looks(monkeypatch, tmp_path: Path, router_env, engine_env, cache):
    for name, value in router_env.items():
        monkeypatch.setenv(name, str(tmp_path / value))
    engine_env = {k: v if v.startswith("~") else str(tmp_path / v) for k, v in engine_env.items()}
    hub_snapshot(tmp_path / cache, "org/model", "abc", {"model.safetensors": 7 * 10**9}, main=True)
    assert weights_gb(spec(model="org/model", env=engine_env))[0] == 7.0


def test_a_hub_id_without_an_org(monkeypatch, tmp_path: Path):
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    hub_snapshot(tmp_path / "hf" / "hub", "gpt2", "abc", {"model.safetensors": 10**9, "pytorch_model.bin": 10**9}, main=True)
    assert weights_gb(spec(model="gpt2"))[0] == 1.0


# -- the draft ------------------------------------------------------------------------------

def test_a_local_draft_is_added(tmp_path: Path):
    target = checkpoint(tmp_path / "target", {"model.safetensors": 16 * 10**9})
    draft = checkpoint(tmp_path / "eagle", {"model.safetensors": 5 * 10**8})
    size, reason = weights_gb(spec(model=str(target), speculative={"model": str(draft), "num_speculative_tokens": 3}))
    assert size == pytest.approx(16.5)
    assert reason == f"16.00 GB in 1 *.safetensors file in {target}; draft: 0.50 GB in 1 *.safetensors file in {draft}"


def test_a_draft_from_the_hub_is_not_counted_and_the_reason_says_so(monkeypatch, tmp_path: Path):
    cache = tmp_path / "hf-cache"
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    hub_snapshot(cache, "org/target", "abc", {"model.safetensors": 8 * 10**9}, main=True)
    size, reason = weights_gb(spec(model="org/target", speculative={"model": "org/eagle", "num_speculative_tokens": 3}))
    assert size == 8.0
    assert reason.endswith("; draft 'org/eagle' not counted (not a local directory)")


def test_ngram_speculation_has_no_draft_weights(tmp_path: Path):
    target = checkpoint(tmp_path / "target", {"model.safetensors": 10**9})
    assert weights_gb(spec(model=str(target), speculative={"method": "ngram", "num_speculative_tokens": 3}))[0] == 1.0


def test_a_local_draft_without_weight_files_makes_the_total_unknown(tmp_path: Path):
    target = checkpoint(tmp_path / "target", {"model.safetensors": 10**9})
    draft = checkpoint(tmp_path / "draft", {})
    assert weights_gb(spec(model=str(target), speculative={"model": str(draft), "num_speculative_tokens": 3})) == (
        None, f"1.00 GB in 1 *.safetensors file in {target}; draft: no weight files (*.safetensors, *.bin, *.pt) in {draft}; set weights_gb")
