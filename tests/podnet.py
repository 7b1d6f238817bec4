"""Pods on a network of their own, for tests that run a deployment's processes as its pods (or
compose's containers) run them: each pod a network namespace with its own address on a bridge,
the pods' DNS names in a /etc/hosts seen by these processes only, all inside a user namespace of
the test's own (`unshare`), so the manifests' fixed ports and host names work and nothing on the
machine changes. Skips the test where user or network namespaces are not allowed."""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
from pathlib import Path

import pytest

SUBNET = "10.77.0"


class PodNetwork:
    def __init__(self, tmp: Path, pods: dict[str, list[str]]) -> None:
        """`pods`: each pod's name and the DNS names it answers to."""
        self.tmp = tmp
        self.addresses = {pod: f"{SUBNET}.{10 + i}" for i, pod in enumerate(pods)}
        hosts = ["127.0.0.1 localhost"] + [f"{self.addresses[pod]} {' '.join(names)}" for pod, names in pods.items()]
        (tmp / "hosts").write_text("\n".join(hosts) + "\n")
        self.logs = tmp / "logs"
        self.logs.mkdir(exist_ok=True)
        self.network = subprocess.Popen(
            ["unshare", "--user", "--map-root-user", "--net", "--mount", "--fork", "sh", "-c",
             f"set -e; mount --bind {tmp / 'hosts'} /etc/hosts; ip link set lo up; ip link add br0 type bridge; "
             f"ip addr add {SUBNET}.1/24 dev br0; ip link set br0 up; echo $$; exec sleep 600"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        line = self.network.stdout.readline() if self.network.stdout else ""
        if not line.strip().isdigit():
            error = self.network.stderr.read() if self.network.stderr else ""
            self.network.kill()
            pytest.skip(f"no user and network namespaces here (unshare: {error.strip()})")
        self.pid = int(line)
        self.running: dict[str, int] = {}

    def run(self, *argv: str, timeout: float = 10) -> subprocess.CompletedProcess[str]:
        """A command on the pods' network (as from another pod); one that has not ended within
        `timeout` (a pod not answering) counts as failed."""
        command = ["nsenter", "-t", str(self.pid), "--user", "--net", "--mount", "--preserve-credentials", *argv]
        try:
            return subprocess.run(command, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired as expired:
            return subprocess.CompletedProcess(command, 124, "", f"timed out after {expired.timeout} s")

    def start(self, pod: str, containers: list[tuple[list[str], dict[str, str]]], workdir: Path | None = None) -> None:
        """The pod's network (its address on the bridge), then its containers: each an argv with
        exactly the environment given (plus PATH), in `workdir` (else the test's), logging to
        logs/POD-N.log."""
        commands = [f"cd {shlex.quote(str(workdir))};"] if workdir else []
        for n, (argv, env) in enumerate(containers):
            assignments = " ".join(shlex.quote(f"{k}={v}") for k, v in {"PATH": os.environ["PATH"], **env}.items())
            log = shlex.quote(str(self.logs / f"{pod}-{n}.log"))
            commands.append(f"env -i {assignments} {shlex.join(argv)} >>{log} 2>&1 &")
        inside = ("while ! ip -4 addr show eth0 2>/dev/null | grep -q inet; do sleep 0.05; done; "
                  + " ".join(commands) + " wait")
        index = list(self.addresses).index(pod)
        link = f"v{index}"
        # The same MAC address every time the pod starts, as its address: the other pods' ARP
        # caches stay right when it is restarted.
        started = self.run("sh", "-c", f"""
            ip link del {link} 2>/dev/null || true
            setsid unshare --net sh -c {shlex.quote(inside)} </dev/null >/dev/null 2>&1 &
            pod=$!
            while [ "$(readlink /proc/$pod/ns/net)" = "$(readlink /proc/self/ns/net)" ]; do sleep 0.01; done
            ip link add {link} type veth peer name eth0 address 02:42:0a:4d:00:{10 + index:02x} netns $pod
            ip link set {link} master br0 up
            nsenter -t $pod --net sh -c 'ip link set lo up; ip addr add {self.addresses[pod]}/24 dev eth0;
                ip link set eth0 up'
            echo $pod""")
        assert started.returncode == 0, started.stderr
        self.running[pod] = int(started.stdout.strip().splitlines()[-1])

    def kill(self, pod: str) -> None:
        """SIGKILL every process of the pod (its network goes with it)."""
        os.killpg(self.running.pop(pod), signal.SIGKILL)

    def log_tails(self, chars: int = 3000) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-chars:]}" for p in sorted(self.logs.iterdir()))

    def close(self) -> None:
        for pod in list(self.running):
            self.kill(pod)
        self.network.kill()
        self.network.wait()
