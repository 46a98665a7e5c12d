"""A production-shaped request trace for the wake-latency bench (issue 32, part 4), from ServeGen.

    python3 bench/traces/make_servegen_trace.py SERVEGEN [--days 1-7] [--start DAY:HH:MM] [--windows 2]
        [--seed 32] [--target 2000] [--out FILE]

SERVEGEN is ServeGen (github.com/alibaba/ServeGen, Apache-2.0) as the `fetch` tool brings it (a bare
git directory: read at its HEAD) or as a checked-out or extracted folder (the one holding `data/`).
Only the standard library is used; nothing of ServeGen's own code is imported or copied.

What ServeGen ships (read from its data, README and loader):

  data/<category>/<pool>/chunk-<N>-trace.csv   one client (N) of one production model pool; one row a
      10-minute window: `start_s,rate,cv,pattern,shape,scale`. start_s counts from the first midnight
      (0, 600, ... 1209000: 14 days for the language pools m-large, m-mid, m-small; one day for
      reason/deepseek-r1 and multimodal/mm-image). rate is requests per second over the window (always
      a whole number of requests / 600, at least 10); cv is the coefficient of variation of the window's
      inter-arrival times; pattern is the distribution fitted to them, Gamma (shape, scale) or Weibull
      (shape, scale), scale in seconds. A window with fewer than 10 requests is `rate 0, cv 0, no pattern`.
  data/<category>/<pool>/chunk-<N>-dataset.json   {slot_start_s: {field: "<python dict literal>"}}: one
      slot every 6 hours (21600 s), each field a PDF {value: probability}. Language: input_tokens,
      output_tokens. Reasoning: the same plus reason_ratio (share of the output that is reasoning).
      Multimodal: text/image/audio/video tokens and counts plus output_tokens. An empty `{}` slot has no data.

What this script does, deterministically (`--seed`):

  1. Reads every client trace of the text pools (language m-large, m-mid, m-small and reasoning
     deepseek-r1; multimodal is left out: none of our ten models takes images).
  2. Takes a stretch of `--windows` consecutive 10-minute windows inside `--days` (1-7 by default;
     a stretch outside it is refused unless `--allow-outside-days`: days 8-14 are kept for an
     independent check).
  3. Candidates: clients active in every window of the stretch (a fitted pattern), mean rate at most
     `--max-rate`, a window CV of at least `--min-cv` (bursty), and length data for the stretch
     (the latest non-empty dataset slot at or before its start, itself inside `--days`; a client whose
     dataset file is 4 MiB or more is left out, as the fetched snapshot lacks those). In order of
     burstiness (highest window CV first), a client is taken while the expected request count stays
     within `--target`; at least `--min-clients` must be taken. Without `--start`, the stretch is
     the one where the most clients are taken so.
  4. Maps each client (one application, one model) to one of the ten MODELS below: models get a
     Zipf(`--zipf`) share of the requests by their popularity rank; clients, largest first, go to the
     model furthest below its share that may serve them (the embedder takes language clients only).
  5. Samples each window of each client: its request count is rate * 600 (the real count at
     `--scale 1`), its inter-arrival gaps come from the window's fitted Gamma/Weibull (so they carry the
     window's CV) and are stretched to fill the window, as ServeGen's own generator does; the gaps are
     laid as a loop around the window from a random offset, so no window edge holds a burst of its own. Prompt and
     output tokens are drawn from the client's input_tokens / output_tokens PDFs of that slot; an
     embeddings request keeps min(prompt, 512) tokens and outputs none.

Output: JSON lines; the first line is {"header": {...}} (source, commit, days, the stretch, every
client's windows and model, the command), then one request a line, sorted by arrival:
{"t": seconds from the start (ms), "client", "model", "kind": chat|embeddings, "prompt_tokens",
"output_tokens"}. A summary (requests per model and per minute, CV of inter-arrivals per client) is
printed as markdown for bench/traces/README.md.
"""

from __future__ import annotations

import argparse
import ast
import bisect
import csv
import io
import json
import random
import statistics
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

REPO_URL = "https://github.com/alibaba/ServeGen"
DAY_S = 86400
WINDOW_S = 600
SLOT_S = 21600  # ServeGen's dataset (length) slots
POOLS = ("language/m-large", "language/m-mid", "language/m-small", "reason/deepseek-r1")
EMBED_MAX_TOKENS = 512  # bge-large's context
# A client whose length file is this big or bigger is left out: the `fetch` snapshot lacks such files,
# and a clone that has them must choose the same clients.
LENGTHS_MAX_BYTES = 4 * 2**20

# Our ten models, as issue 32 lists them big to small (mixtral-8x7b: 47B in all, 13B active):
# (name, size in B parameters, kind, popularity rank: 1 = most requested).
# The 70B is the second most popular: a big model that is also hot.
MODELS = (
    ("llama-70b", 70, "chat", 2),
    ("qwen-32b", 32, "chat", 5),
    ("mixtral-8x7b", 47, "chat", 9),
    ("gemma-27b", 27, "chat", 8),
    ("llama-13b", 13, "chat", 7),
    ("mistral-7b", 7, "chat", 6),
    ("llama-8b", 8, "chat", 1),
    ("qwen-7b", 7, "chat", 3),
    ("phi-3-mini", 3.8, "chat", 10),
    ("bge-large", 0.34, "embeddings", 4),
)
MODEL_NAMES = tuple(m[0] for m in MODELS)
KIND = {m[0]: m[2] for m in MODELS}


# -- reading ServeGen ------------------------------------------------------------------------------

class Source:
    """ServeGen's files, from a bare git directory (at HEAD) or a folder."""

    def __init__(self, path: Path):
        self.path = path
        self.git = (path / "HEAD").is_file() and (path / "objects").is_dir()
        if not self.git and not (path / "data").is_dir():
            sys.exit(f"{path}: neither a git directory nor a folder holding data/")
        self.commit = self._git("rev-parse", "HEAD").strip() if self.git else None

    def _git(self, *args: str) -> str:
        return subprocess.run(["git", "--git-dir", str(self.path), *args], capture_output=True, text=True,
                              check=True).stdout

    def listing(self) -> dict[str, int | None]:
        """path under data/ -> its size in bytes, None where the content is not there (a snapshot
        lacks its largest files)."""
        if not self.git:
            return {p.relative_to(self.path).as_posix(): p.stat().st_size
                    for p in (self.path / "data").rglob("*") if p.is_file()}
        out = {}
        for line in self._git("ls-tree", "-r", "-l", "HEAD", "data").splitlines():
            meta, name = line.split("\t", 1)
            size = meta.split()[3]
            out[name] = int(size) if size.isdigit() else None
        return out

    def read(self, names: list[str]) -> dict[str, str]:
        if not self.git:
            return {n: (self.path / n).read_text() for n in names}
        batch = "".join(f"HEAD:{n}\n" for n in names).encode()
        raw = subprocess.run(["git", "--git-dir", str(self.path), "cat-file", "--batch"], input=batch,
                             capture_output=True, check=True).stdout
        out, at = {}, 0
        for n in names:
            end = raw.index(b"\n", at)
            head = raw[at:end].split()
            if head[-1] == b"missing":
                at = end + 1
                continue
            size = int(head[2])
            out[n] = raw[end + 1:end + 1 + size].decode()
            at = end + 1 + size + 1
        return out


@dataclass
class Window:
    start: int
    rate: float  # requests per second
    cv: float
    pattern: str  # "Gamma" | "Weibull" | "" (fewer than 10 requests)
    shape: float
    scale: float  # seconds


@dataclass
class Client:
    pool: str  # "language/m-large"
    number: int  # chunk-<number>
    windows: dict[int, Window]
    has_lengths: bool
    model: str = ""
    lengths: dict[str, tuple[list[int], list[float]]] = field(default_factory=dict)  # field -> (values, cdf)
    length_slot: int = -1

    @property
    def id(self) -> str:
        return f"{self.pool.split('/')[1]}/{self.number}"

    @property
    def reasoning(self) -> bool:
        return self.pool.startswith("reason/")

    def file(self, kind: str) -> str:
        return f"data/{self.pool}/chunk-{self.number}-{kind}"


def parse_trace(text: str) -> dict[int, Window]:
    out = {}
    for row in csv.reader(io.StringIO(text)):
        if row:
            start, rate, cv, pattern, shape, scale = row
            out[int(start)] = Window(int(start), float(rate), float(cv), pattern, float(shape), float(scale))
    return out


def load_clients(src: Source) -> list[Client]:
    files = src.listing()
    traces = sorted(n for n in files if n.endswith("-trace.csv") and n.split("/")[1] + "/" + n.split("/")[2] in POOLS)
    texts = src.read(traces)
    clients = []
    for name in traces:
        _, category, pool, base = name.split("/")
        number = int(base.split("-")[1])
        client = Client(f"{category}/{pool}", number, parse_trace(texts[name]), False)
        size = files.get(client.file("dataset.json"))
        client.has_lengths = size is not None and size < LENGTHS_MAX_BYTES
        clients.append(client)
    return sorted(clients, key=lambda c: (c.pool, c.number))


def pdf_to_cdf(literal: str) -> tuple[list[int], list[float]]:
    pdf = ast.literal_eval(literal)  # ServeGen stores each PDF as a Python dict literal inside the JSON
    values = sorted(pdf)
    total, acc, cdf = sum(pdf.values()), 0.0, []
    for v in values:
        acc += pdf[v]
        cdf.append(acc / total)
    return [int(v) for v in values], cdf


def attach_lengths(src: Source, clients: list[Client], stretch_start: int, lo_s: int) -> None:
    """The latest non-empty length slot at or before the stretch (and not before the allowed days)."""
    texts = src.read([c.file("dataset.json") for c in clients])
    for c in clients:
        text = texts.get(c.file("dataset.json"))
        if text is None:
            continue
        slots = json.loads(text)
        for start in sorted((int(s) for s in slots), reverse=True):
            if start > stretch_start or start < lo_s:
                continue
            fields = slots[str(start)]
            if all(fields.get(f, "{}").strip() != "{}" for f in ("input_tokens", "output_tokens")):
                c.lengths = {f: pdf_to_cdf(fields[f]) for f in ("input_tokens", "output_tokens")}
                c.length_slot = start
                break


# -- choosing the stretch, the clients and their models --------------------------------------------

def parse_days(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition("-")
    lo, hi = int(lo), int(hi or lo)
    if not 1 <= lo <= hi <= 14:
        sys.exit(f"--days {text}: want A-B with 1 <= A <= B <= 14")
    return lo, hi


def parse_start(text: str) -> int:
    """DAY:HH:MM (day 1 = the first day) or seconds from the first midnight; a window boundary."""
    if ":" in text:
        day, hh, mm = (int(x) for x in text.split(":"))
        start = (day - 1) * DAY_S + hh * 3600 + mm * 60
    else:
        start = int(text)
    if start % WINDOW_S:
        sys.exit(f"--start {text}: not on a 10-minute window boundary")
    return start


def candidates(clients: list[Client], start: int, n_windows: int, args: argparse.Namespace) -> list[Client]:
    out = []
    for c in clients:
        ws = [c.windows.get(start + i * WINDOW_S) for i in range(n_windows)]
        if not c.has_lengths or not all(w and w.pattern and w.rate > 0 for w in ws):
            continue
        if sum(w.rate for w in ws) / n_windows <= args.max_rate and max(w.cv for w in ws) >= args.min_cv:
            out.append(c)
    return out


def burstiness(c: Client, start: int, n_windows: int) -> float:
    return max(c.windows[start + i * WINDOW_S].cv for i in range(n_windows))


def expected(c: Client, start: int, n_windows: int, scale: float) -> float:
    return sum(c.windows[start + i * WINDOW_S].rate for i in range(n_windows)) * WINDOW_S * scale


def take(pool: list[Client], start: int, args: argparse.Namespace) -> list[Client]:
    """The burstiest first (highest window CV), each while the expected total stays within --target."""
    chosen, total = [], 0.0
    for c in sorted(pool, key=lambda c: (-burstiness(c, start, args.windows), c.id)):
        e = expected(c, start, args.windows, args.scale)
        if total + e <= args.target:
            chosen.append(c)
            total += e
    return chosen


def choose_stretch(clients: list[Client], lo_s: int, hi_s: int, args: argparse.Namespace) -> int:
    """The stretch inside the days where the most bursty clients can be taken; the earliest of equals."""
    span = args.windows * WINDOW_S
    best, best_start = -1, None
    for start in range(lo_s, hi_s - span + 1, WINDOW_S):
        n = len(take(candidates(clients, start, args.windows, args), start, args))
        if n > best:
            best, best_start = n, start
    return best_start


def select_clients(pool: list[Client], start: int, args: argparse.Namespace) -> list[Client]:
    chosen = take([c for c in pool if c.lengths], start, args)
    if len(chosen) < args.min_clients:
        sys.exit(f"only {len(chosen)} clients fit (want {args.min_clients}): widen --max-rate/--min-cv/--target")
    return chosen


def zipf_shares(s: float) -> dict[str, float]:
    weights = {name: 1 / rank ** s for name, _, _, rank in MODELS}
    total = sum(weights.values())
    return {name: w / total for name, w in weights.items()}


def assign_models(chosen: list[Client], start: int, args: argparse.Namespace) -> None:
    share = zipf_shares(args.zipf)
    total = sum(expected(c, start, args.windows, args.scale) for c in chosen)
    got = dict.fromkeys(MODEL_NAMES, 0.0)
    for c in sorted(chosen, key=lambda c: (-expected(c, start, args.windows, args.scale), c.id)):
        allowed = [m for m in MODEL_NAMES if KIND[m] == "chat" or not c.reasoning]
        # the model furthest below its share; of equals, the more popular one
        c.model = max(allowed, key=lambda m: (share[m] * total - got[m], share[m]))
        got[c.model] += expected(c, start, args.windows, args.scale)
    empty = [m for m, n in got.items() if n == 0]
    if empty:
        sys.exit(f"no client for {', '.join(empty)}: take more clients (--target, --max-rate, --min-cv)")


# -- sampling ----------------------------------------------------------------------------------------

def gap(rng: random.Random, w: Window) -> float:
    if w.pattern == "Gamma":
        return rng.gammavariate(w.shape, w.scale)
    if w.pattern == "Weibull":
        return rng.weibullvariate(w.scale, w.shape)  # the standard library takes (scale, shape)
    raise ValueError(f"unknown arrival pattern {w.pattern!r}")


def arrivals(rng: random.Random, w: Window, scale: float) -> list[float]:
    """The window's requests: rate * 600 of them (stochastically rounded when scaled), their n gaps drawn
    from the fitted pattern and stretched to fill the window as one loop around it, turned by a uniform
    offset: no request is pinned to the window's edges, and every gap, the one across the edge too,
    is one the pattern drew."""
    mean = w.rate * WINDOW_S * scale
    n = int(mean) + (rng.random() < mean - int(mean))
    if n == 0:
        return []
    gaps = [gap(rng, w) for _ in range(n)]
    total = sum(gaps) or 1.0
    offset = rng.random() * WINDOW_S
    out, at = [], offset
    for g in gaps:
        at += g * WINDOW_S / total
        out.append(w.start + at % WINDOW_S)
    return sorted(out)


def draw(rng: random.Random, values: list[int], cdf: list[float]) -> int:
    return values[min(bisect.bisect_left(cdf, rng.random()), len(values) - 1)]


def sample(chosen: list[Client], start: int, args: argparse.Namespace) -> list[dict]:
    requests = []
    for c in chosen:
        rng = random.Random(f"{args.seed}:{c.id}")  # one stream a client: the others do not move with it
        for i in range(args.windows):
            for t in arrivals(rng, c.windows[start + i * WINDOW_S], args.scale):
                prompt = max(1, draw(rng, *c.lengths["input_tokens"]))
                output = max(1, draw(rng, *c.lengths["output_tokens"]))
                if KIND[c.model] == "embeddings":
                    prompt, output = min(prompt, EMBED_MAX_TOKENS), 0
                requests.append({"t": round(t - start, 3), "client": c.id, "model": c.model, "kind": KIND[c.model],
                                 "prompt_tokens": prompt, "output_tokens": output})
    requests.sort(key=lambda r: (r["t"], r["client"]))
    return requests


# -- the summary -------------------------------------------------------------------------------------

def cv(xs: list[float]) -> float | None:
    return statistics.pstdev(xs) / statistics.fmean(xs) if len(xs) > 1 and statistics.fmean(xs) > 0 else None


def gaps_of(ts: list[float]) -> list[float]:
    return [b - a for a, b in zip(ts, ts[1:])]


def summary(header: dict, requests: list[dict]) -> str:
    seconds = header["stretch"]["seconds"]
    lines = [f"{len(requests)} requests over {seconds} s from {len(header['clients'])} clients.", "",
             "| model | kind | clients | requests | share | CV of inter-arrivals | longest gap (s) | gaps >= 10 s | gaps >= 60 s |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for name in MODEL_NAMES:
        ts = [r["t"] for r in requests if r["model"] == name]
        g = gaps_of(ts)
        k = sum(c["model"] == name for c in header["clients"])
        got = cv(g)
        lines.append(f"| {name} | {KIND[name]} | {k} | {len(ts)} | {100 * len(ts) / len(requests):.1f}% | "
                     f"{'-' if got is None else f'{got:.2f}'} | {max(g, default=0):.1f} | {sum(x >= 10 for x in g)} | "
                     f"{sum(x >= 60 for x in g)} |")
    minutes = [0] * (seconds // 60)
    for r in requests:
        minutes[min(int(r["t"] // 60), len(minutes) - 1)] += 1
    lines += ["", "Requests per minute: " + ", ".join(map(str, minutes)) +
              f" (min {min(minutes)}, median {statistics.median(minutes):g}, max {max(minutes)}).", "",
              "| client | model | requests | ServeGen window CVs | CV of inter-arrivals in the trace | prompt tokens (median) | output tokens (median) |",
              "| --- | --- | ---: | --- | ---: | ---: | ---: |"]
    for c in header["clients"]:
        mine = [r for r in requests if r["client"] == c["id"]]
        got = cv(gaps_of([r["t"] for r in mine]))
        lines.append(f"| {c['id']} | {c['model']} | {len(mine)} | {', '.join(format(w['cv'], '.2f') for w in c['windows'])} | "
                     f"{'-' if got is None else f'{got:.2f}'} | {statistics.median(r['prompt_tokens'] for r in mine):g} | "
                     f"{statistics.median(r['output_tokens'] for r in mine):g} |")
    same = len(requests) - len({(r["client"], r["t"]) for r in requests})
    lines += ["", f"Requests arriving in the same millisecond as an earlier one of their client: {same}."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("servegen", type=Path, help="ServeGen: its bare git directory (read at HEAD) or a folder holding data/")
    p.add_argument("--days", default="1-7", help="the days the stretch and its length data may come from (default 1-7)")
    p.add_argument("--allow-outside-days", action="store_true", help="let --start name a stretch outside --days")
    p.add_argument("--start", help="the stretch's first window, DAY:HH:MM or seconds (default: the burstiest)")
    p.add_argument("--windows", type=int, default=2, help="consecutive 10-minute windows (default 2: 20 minutes)")
    p.add_argument("--seed", type=int, default=32)
    p.add_argument("--target", type=float, default=2000, help="at most this many expected requests (default 2000)")
    p.add_argument("--max-rate", type=float, default=0.3, help="a client's mean rate in the stretch, req/s (default 0.3)")
    p.add_argument("--min-cv", type=float, default=1.5, help="a client's highest window CV in the stretch (default 1.5)")
    p.add_argument("--min-clients", type=int, default=12)
    p.add_argument("--zipf", type=float, default=1.0, help="the exponent of the models' popularity (default 1.0)")
    p.add_argument("--scale", type=float, default=1.0, help="multiply every rate (default 1: the real counts)")
    p.add_argument("--out", type=Path, help="default: servegen-dA-B.jsonl beside this script, A-B the --days")
    args = p.parse_args(argv)

    lo, hi = parse_days(args.days)
    args.out = args.out or Path(__file__).with_name(f"servegen-d{lo}-{hi}.jsonl")
    lo_s, hi_s = (lo - 1) * DAY_S, hi * DAY_S
    src = Source(args.servegen)
    clients = load_clients(src)
    if args.start is None:
        start = choose_stretch(clients, lo_s, hi_s, args)
    else:
        start = parse_start(args.start)
        if not (lo_s <= start and start + args.windows * WINDOW_S <= hi_s) and not args.allow_outside_days:
            sys.exit(f"--start {args.start}: the stretch is outside days {args.days} (--allow-outside-days to take it)")
    end = start + args.windows * WINDOW_S
    pool = candidates(clients, start, args.windows, args)
    attach_lengths(src, pool, start, lo_s if not args.allow_outside_days else 0)
    chosen = select_clients(pool, start, args)
    assign_models(chosen, start, args)
    requests = sample(chosen, start, args)

    given = [a for a in (sys.argv[1:] if argv is None else argv) if a != str(args.servegen)]
    command = " ".join(["python3 bench/traces/make_servegen_trace.py SERVEGEN", *given])
    header = {
        "source": f"ServeGen, Alibaba, Apache-2.0: {REPO_URL}", "commit": src.commit,
        "days": [lo, hi], "allow_outside_days": args.allow_outside_days,
        "stretch": {"start_s": start, "end_s": end, "seconds": end - start, "day": start // DAY_S + 1,
                    "time": f"{start % DAY_S // 3600:02d}:{start % 3600 // 60:02d}",
                    "window_starts_s": [start + i * WINDOW_S for i in range(args.windows)]},
        "pools": list(POOLS), "seed": args.seed, "target": args.target, "max_rate": args.max_rate,
        "min_cv": args.min_cv, "zipf": args.zipf, "scale": args.scale,
        "models": [{"name": n, "params_b": b, "kind": k, "rank": r} for n, b, k, r in MODELS],
        "clients": [{"id": c.id, "pool": c.pool, "model": c.model, "kind": KIND[c.model], "length_slot_s": c.length_slot,
                     "windows": [{"start_s": w.start, "rate": w.rate, "cv": round(w.cv, 4), "pattern": w.pattern,
                                  "shape": round(w.shape, 6), "scale": round(w.scale, 6)}
                                 for w in (c.windows[s] for s in range(start, end, WINDOW_S))]}
                    for c in sorted(chosen, key=lambda c: c.id)],
        "fields": ["t", "client", "model", "kind", "prompt_tokens", "output_tokens"],
        "requests": len(requests), "command": command,
    }
    with args.out.open("w") as f:
        f.write(json.dumps({"header": header}, separators=(",", ":")) + "\n")
        for r in requests:
            f.write(json.dumps(r, separators=(",", ":")) + "\n")
    print(f"wrote {args.out} ({args.out.stat().st_size} bytes)\n")
    print(summary(header, requests))


if __name__ == "__main__":
    main()
