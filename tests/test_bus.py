import shutil
import subprocess
import time

import pytest

from inferbus.bus import connection as bus
from inferbus.local.ports import free_port

pytestmark = pytest.mark.slow


def test_old_servers_are_refused_with_a_clear_message() -> None:
    with pytest.raises(bus.ServerTooOld, match="2.9.10 is too old"):
        bus.check_server_version("2.9.10")
    bus.check_server_version("2.11.0")
    bus.check_server_version("2.15.1-beta")


@pytest.mark.skipif(
    not shutil.which("nats-server", path="/usr/sbin:/usr/bin"), reason="no system nats-server to compare"
)
async def test_connect_refuses_a_real_old_server(tmp_path) -> None:  # type: ignore[no-untyped-def]
    binary = shutil.which("nats-server", path="/usr/sbin:/usr/bin")
    version = subprocess.run([binary, "--version"], capture_output=True, text=True).stdout
    if "v2.9" not in version and "v2.10" not in version:
        pytest.skip(f"system nats-server is {version.strip()}, not an old one")
    port = free_port()
    server = subprocess.Popen([binary, "-a", "127.0.0.1", "-p", str(port), "-js", "-sd", str(tmp_path)])
    try:
        time.sleep(0.5)
        with pytest.raises(bus.ServerTooOld):
            await bus.connect(f"nats://127.0.0.1:{port}", name="test")
    finally:
        server.terminate()
        server.wait()
