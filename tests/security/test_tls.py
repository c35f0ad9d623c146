"""The whole PD path over TLS on loopback, with a throwaway CA."""

from __future__ import annotations

import ssl
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
import trustme

from pdtrio.config import ConfigError, SecurityConfig, WorkerConfig
from pdtrio.security import client_tls_context, server_tls_context, system_tls_context
from tests.cluster import client, running_cluster, synthetic_worker, wait_until_idle

SECRET = "tls-test-secret"


def _certificates(tmp_path: Path) -> dict[str, str]:
    ca = trustme.CA()
    server = ca.issue_cert("127.0.0.1", "localhost")
    paths = {
        "ca": tmp_path / "ca.pem",
        "cert": tmp_path / "worker.pem",
        "key": tmp_path / "worker.key",
    }
    ca.cert_pem.write_to_path(str(paths["ca"]))
    server.cert_chain_pems[0].write_to_path(str(paths["cert"]))
    for extra in server.cert_chain_pems[1:]:
        extra.write_to_path(str(paths["cert"]), append=True)
    server.private_key_pem.write_to_path(str(paths["key"]))
    return {name: str(path) for name, path in paths.items()}


@pytest.mark.parametrize("kv_transport", ["tcp", "nixl"])
async def test_router_workers_and_kv_handoff_all_over_tls(
    tmp_path: Path, kv_transport: str
) -> None:
    files = _certificates(tmp_path)
    tls: dict[str, Any] = {
        "tls_cert_file": files["cert"],
        "tls_key_file": files["key"],
        "tls_ca_file": files["ca"],
        "kv_transport": kv_transport,
    }
    security = SecurityConfig(worker_secret=SECRET, worker_tls_ca_file=files["ca"])

    def make(role: str) -> Any:
        return synthetic_worker(role, secret=SECRET, worker_overrides=tls)

    async with running_cluster(make_worker=make, security=security) as cluster:
        prefill, decode = cluster.workers
        assert prefill.url.startswith("https://")
        async with client(cluster) as http:
            for stream in (False, True):
                response = await http.post(
                    "/v1/completions",
                    json={
                        "model": "synthetic",
                        "prompt": "over tls",
                        "max_tokens": 6,
                        "stream": stream,
                    },
                )
                assert response.status_code == 200, response.text
        pulls = decode.transport.info()
        assert sum(dict(pulls.get("pulls", {})).values()) == 2, pulls
        # plain HTTP to a TLS worker gets nowhere; TLS without the CA is not trusted
        with pytest.raises(httpx.HTTPError):
            async with httpx.AsyncClient() as plain:
                await plain.get(prefill.url.replace("https", "http") + "/health")
        with pytest.raises(httpx.ConnectError):
            async with httpx.AsyncClient() as untrusting:
                await untrusting.get(prefill.url + "/health")
        async with httpx.AsyncClient(verify=client_tls_context(files["ca"]) or True) as trusting:
            assert (await trusting.get(prefill.url + "/health")).status_code == 200
        await wait_until_idle(cluster)


async def test_a_kv_port_over_tls_refuses_a_plain_peer(tmp_path: Path) -> None:
    files = _certificates(tmp_path)
    tls = {"tls_cert_file": files["cert"], "tls_key_file": files["key"], "kv_transport": "tcp"}
    worker = synthetic_worker("prefill", worker_overrides=tls)
    async with trio.open_nursery() as nursery:
        await nursery.start(worker.run)
        stream = await trio.open_tcp_stream("127.0.0.1", worker.transfer_endpoint[1])
        async with stream:
            await stream.send_all(b"B" + bytes(32) + b"\x00\x00\x00\x02\x92\xa1")
            with trio.fail_after(10):
                answer = await stream.receive_some(4096)
        assert b"granted" not in answer  # a TLS alert at most, never an answer
        nursery.cancel_scope.cancel()


def test_tls_files_are_checked_at_start(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="both"):
        server_tls_context(str(tmp_path / "cert.pem"), "")
    with pytest.raises(ConfigError, match="cannot load the TLS certificate"):
        server_tls_context(str(tmp_path / "cert.pem"), str(tmp_path / "key.pem"))
    with pytest.raises(ConfigError, match="CA file"):
        client_tls_context(str(tmp_path / "missing-ca.pem"))
    assert WorkerConfig(tls_cert_file="x").tls_cert_file == "x"


def test_the_shared_default_context_verifies_as_httpx_own_does() -> None:
    """One context for every client that trusts the default CAs, built once: sharing it
    must not weaken what each client checks."""
    shared = system_tls_context()
    assert system_tls_context() is shared
    own = httpx.create_ssl_context()
    assert shared.verify_mode == own.verify_mode == ssl.CERT_REQUIRED
    assert shared.check_hostname and own.check_hostname
    assert shared.minimum_version == own.minimum_version
    assert len(shared.get_ca_certs()) == len(own.get_ca_certs()) > 0
