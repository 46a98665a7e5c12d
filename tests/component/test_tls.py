"""Engines attached by `url: https://…`: the router speaks TLS to them on every path (boot,
health, the gate, proxied requests), verified against `tls_ca_file`, and keeps the url's path
prefix. The engine is the simulator behind a TLS-only listener that serves it under /team-a,
with certificates made at test time."""

from __future__ import annotations

import datetime
import ipaddress
import ssl
import subprocess
import sys
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from tests.support import RouterProcess, ask, client, eventually, roster_dict

REPO = Path(__file__).resolve().parents[2]
PREFIX = "/team-a"
HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "content-length", "host"}


def _name(common: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common)])


def make_ca(common: str) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(_name(common)).issuer_name(_name(common))
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(hours=1)).not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True, content_commitment=False,
                                         key_encipherment=False, data_encipherment=False, key_agreement=False,
                                         encipher_only=False, decipher_only=False), critical=True)
            .sign(key, hashes.SHA256()))
    return cert, key


def make_tls_files(tmp_path: Path) -> dict[str, Path]:
    """A CA, a server certificate it signed for localhost, and another CA that signed nothing."""
    ca, ca_key = make_ca("hotswap test CA")
    other, _ = make_ca("some other CA")
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.timezone.utc)
    leaf = (x509.CertificateBuilder().subject_name(_name("localhost")).issuer_name(ca.subject)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(hours=1)).not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                           critical=False)
            .add_extension(x509.ExtendedKeyUsage([x509.oid.ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
            .sign(ca_key, hashes.SHA256()))
    files = {"ca": tmp_path / "ca.pem", "other_ca": tmp_path / "other-ca.pem",
             "cert": tmp_path / "server.pem", "key": tmp_path / "server-key.pem"}
    files["ca"].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    files["other_ca"].write_bytes(other.public_bytes(serialization.Encoding.PEM))
    files["cert"].write_bytes(leaf.public_bytes(serialization.Encoding.PEM))
    files["key"].write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                               serialization.NoEncryption()))
    return files


class TLSFront:
    """A TLS-only listener that serves a plaintext engine under PREFIX (as an ingress would) and
    records every request it was given: a request it saw came over TLS, with the prefix."""

    def __init__(self, engine_url: str, files: dict[str, Path]) -> None:
        self.engine_url = engine_url
        self.files = files
        self.seen: list[tuple[str, str]] = []

    async def start(self) -> int:
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.load_cert_chain(self.files["cert"], self.files["key"])
        self.session = aiohttp.ClientSession()
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self.forward)
        self.runner = web.AppRunner(app, access_log=None)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0, ssl_context=context)
        await site.start()
        return site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]

    async def forward(self, request: web.Request) -> web.StreamResponse:
        self.seen.append((request.method, request.path))
        if not request.path.startswith(PREFIX + "/"):
            return web.json_response({"detail": "Not Found"}, status=404)
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_BY_HOP}
        async with self.session.request(request.method, self.engine_url + request.path_qs[len(PREFIX):],
                                        headers=headers, data=await request.read()) as upstream:
            response = web.StreamResponse(status=upstream.status, headers={
                k: v for k, v in upstream.headers.items() if k.lower() not in HOP_BY_HOP})
            await response.prepare(request)
            async for data in upstream.content.iter_any():
                await response.write(data)
            await response.write_eof()
            return response

    async def close(self) -> None:
        await self.runner.cleanup()
        await self.session.close()


@pytest.fixture
async def tls_engine(tmp_path, start_sim_engine):
    files = make_tls_files(tmp_path)
    sim = start_sim_engine("--sim-token-rate", "5000", model="sim/tls")
    front = TLSFront(sim.url, files)
    port = await front.start()
    yield front, port, files
    await front.close()


async def test_an_https_engine_is_spoken_to_over_tls_under_its_path_prefix_on_every_path(tls_engine, start_router):
    front, port, files = tls_engine
    router = await start_router(roster_dict({"name": "tls", "url": f"https://localhost:{port}{PREFIX}",
                                             "tls_ca_file": str(files["ca"])}))
    c = client(router)
    assert await ask(c, "tls")
    stream = await c.completions.create(model="tls", prompt="over tls", max_tokens=8, stream=True)
    assert "".join([chunk.choices[0].text async for chunk in stream if chunk.choices])
    proxied = [seen for seen in front.seen if seen == ("POST", f"{PREFIX}/v1/completions")]
    assert len(proxied) >= 3, f"the canary, the request and the stream, all with the prefix: {front.seen}"
    assert ("GET", f"{PREFIX}/health") in front.seen  # the control client too
    assert all(path.startswith(PREFIX + "/") for _, path in front.seen), front.seen
    async with aiohttp.ClientSession() as s:  # and the engine answers nothing but TLS
        with pytest.raises(aiohttp.ClientError):
            async with s.get(f"http://127.0.0.1:{port}{PREFIX}/health") as r:
                await r.read()


async def test_an_https_engine_whose_certificate_the_ca_file_does_not_vouch_for_fails_its_boot_plainly(tls_engine, tmp_path):
    front, port, files = tls_engine
    router = RouterProcess(roster_dict({"name": "tls", "url": f"https://localhost:{port}{PREFIX}",
                                        "tls_ca_file": str(files["other_ca"])}), tmp_path)
    try:
        await eventually(lambda: "boot finished" in router.log(), timeout=30, what="the end-of-boot summary")
        log = router.log()
        assert f"engine tls: boot failed: GET /health: TLS with https://localhost:{port}{PREFIX} failed:" in log
        assert "certificate verify failed" in log and "tls_ca_file" in log
        assert not front.seen, "nothing reached the engine"
    finally:
        assert router.stop() == 0


def test_check_refuses_a_roster_naming_a_missing_ca_file_with_its_line(tmp_path):
    roster = tmp_path / "roster.yaml"
    roster.write_text("models:\n"
                      "  - name: tls\n"
                      "    url: https://engine.internal:8443/team-a\n"
                      f"    tls_ca_file: {tmp_path}/nowhere/ca.pem\n")  # line 4
    run = subprocess.run([sys.executable, "-m", "router.cli", "check", "--config", str(roster)], cwd=REPO,
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 2, run.stdout + run.stderr
    assert f"{roster}:4:18: models[0].tls_ca_file: {tmp_path}/nowhere/ca.pem: no such file" in run.stdout + run.stderr
