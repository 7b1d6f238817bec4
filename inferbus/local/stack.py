"""Run the platform as local processes: NATS, Redis, gateway, router, engines and workers.

Used by `inferbus up`, by the test fixtures and by the benchmarks, so that all three exercise the
same start-up code. Every process gets a free port and logs to `<state_dir>/logs/<name>.log`.

The bus is closed: unless NATS_URL names a server of the operator's, the stack generates one NATS
identity per service (`bus_auth`), writes nats-server's config with their permissions and Redis's
with a password (0600, in a 0700 state dir), and hands each service only its own credentials. The
operator's identity (`ops`) and the URLs are in `<state_dir>/platform.json` (0600), where the
`inferbus` CLI finds the running platform.

This is the shell: what the platform is made of is `StackConfig` (`stack_config`, imported with
`Stack` from here), and the pieces are in their own modules (`replicas`, `process`, `servers`,
`probes`, `ports`, `private_files`).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from functools import partial
from pathlib import Path

from inferbus.bus.auth import LocalIdentities, new_password
from inferbus.local.ports import free_port
from inferbus.local.private_files import make_private_tree, private_dir, remove_secrets, write_private
from inferbus.local.probes import http_ok, logged, redis_reachable
from inferbus.local.process import START_WAVES, Process, restart_in_start_up, start_wave, stop_grace_s
from inferbus.local.replicas import replica_processes
from inferbus.local.servers import nats_config, nats_server_binary, redis_config, redis_server_binary
from inferbus.local.stack_config import StackConfig, autoscaler_env
from inferbus.runtime.supervise import EXIT_GPU_DEATH

PLATFORM_FILE = "platform.json"
GATEWAY_ID = "gateway"  # the local gateway's id: its NATS identity may use its own token and cancel subjects only
BATCH_SERVICE_ID = "main"


def read_platform_file(state_dir: Path) -> dict[str, object] | None:
    """What `inferbus up` wrote about the platform it runs from `state_dir`, if it is running."""
    try:
        data = json.loads((state_dir / PLATFORM_FILE).read_text())
    except (OSError, ValueError):
        return None
    pid = data.get("launcher_pid")
    if not isinstance(pid, int) or not _pid_alive(pid):
        return None
    return data


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class Stack:
    """The whole platform as child processes, started in dependency order, stopped in reverse."""

    def __init__(self, config: StackConfig) -> None:
        self.config = config
        self.processes: list[Process] = []
        self.nats_server_url = config.nats_url or ""  # what services connect to, with their own credentials
        self.nats_url = self.nats_server_url  # the operator's: with the `ops` credentials when the stack made them
        self.redis_url = config.redis_url or ""
        self.gateway_url = f"http://{config.gateway_host}:{config.gateway_port}"
        self.identities: LocalIdentities | None = None  # None: NATS is the operator's, credentials from NATS_*
        self.nats_tls_ca = ""  # with `tls`: the CA file every NATS client verifies the server with
        self.model_dir = ""
        self.zones: list[str] = []  # with config.zones > 1: the zones' names
        self.gateway_urls: dict[str, str] = {}  # zone → its gateway's URL (zone "" on a single-zone platform)
        self.nats_urls: list[str] = []  # every NATS node's URL, with the `ops` credentials
        self.nats_monitor_url = ""  # the monitoring endpoint (/varz, /connz) of the NATS the stack starts

    def _env(self, **extra: str) -> dict[str, str]:
        env = dict(os.environ)
        env.update(
            NATS_URL=self.nats_server_url, REDIS_URL=self.redis_url, INFERBUS_MODEL=self.config.model,
            INFERBUS_LOG_LEVEL=self.config.log_level, PYTHONUNBUFFERED="1", INFERBUS_MODEL_DIR=self.model_dir,
        )
        if self.nats_tls_ca:
            env["NATS_TLS_CA"] = self.nats_tls_ca
        # The gateway (uploads, downloads) and the batch service (inputs, outputs) share the files.
        env.setdefault("INFERBUS_FILES_DIR", str(self.config.state_dir / "files"))
        env.setdefault("INFERBUS_STATE_DIR", str(self.config.state_dir / "state"))  # usage outboxes
        env.setdefault("INFERBUS_EXPORT_DIR", str(self.export_dir))  # billing's monthly exports
        if self.config.time_scale not in (0.0, 1.0):  # slowed engines: the router prices adapters in engine time
            env["INFERBUS_ROUTER_TIME_SCALE"] = str(self.config.time_scale)
        env.update(self.config.extra_env)
        env.update(extra)
        return env

    def credentials(self, process: str) -> dict[str, str]:
        """NATS_USER/NATS_PASSWORD for the process named `process`: its own identity, the role-wide
        worker identity for a worker without one, none for processes that do not use NATS (or with
        an outside NATS, whose credentials come from the environment)."""
        if self.identities is None:
            return {}
        chosen = self.identities.by_name.get(process)
        if chosen is None and process.startswith("worker-"):
            chosen = self.identities["worker"]
        if chosen is None and process.startswith("router-"):
            chosen = self.identities["router"]
        if chosen is None or chosen.role == "ops":
            return {}
        if self.config.callout:
            return {"NATS_USER": chosen.user, "NATS_TOKEN_FILE": str(self.config.state_dir / "tokens" / chosen.user)}
        return {"NATS_USER": chosen.user, "NATS_PASSWORD": chosen.password}

    def _callout_setup(self, zone_env: list[dict[str, str]] | None = None) -> Callable[[str], str]:
        """A callout platform: a token per service, the callout service (one per zone, each with its
        `zone_env`, on a multi-zone platform), and what turns a node's nats-server config (from
        `nats_config`) into the callout's (its users replaced by the callout's accounts)."""
        import nkeys

        from inferbus.bus.callout import CALLOUT_ACCOUNT, new_account_seed, server_config

        assert self.identities is not None
        c = self.config
        if c.autoscale:
            raise ValueError("callout: the workers an autoscaler starts have no token of their own")
        seed = new_account_seed()
        auth_password = new_password()
        ops = self.identities["ops"]
        tokens = {}
        for identity in self.identities.all():
            if identity.role in ("ops", "producer") or (identity.role == "worker" and identity.scope is None):
                continue
            token = new_password()
            write_private(c.state_dir / "tokens" / identity.user, token + "\n")
            tokens[token] = {"namespace": "local", "service_account": identity.role, "pod": identity.user}
        write_private(c.state_dir / "callout-tokens.json", json.dumps(tokens))
        for zone, env in zip(self.zones or [""], zone_env or [{}], strict=True):
            name = f"auth-callout-{zone}" if zone else "auth-callout"
            callout_log = c.state_dir / "logs" / f"{name}.log"
            self._add(name, self._inferbus("auth-callout"), partial(logged, callout_log, b'"auth_callout_ready"'),
                      "per-service tokens" + (f", zone {zone}" if zone else ""), NATS_USER="auth",
                      NATS_PASSWORD=auth_password, INFERBUS_CALLOUT_ISSUER_SEED=seed.decode(),
                      INFERBUS_CALLOUT_ACCOUNT=CALLOUT_ACCOUNT, INFERBUS_CALLOUT_NAMESPACE="local",
                      INFERBUS_CALLOUT_TOKENS_FILE=str(c.state_dir / "callout-tokens.json"), INFERBUS_LOG_LEVEL="info",
                      **{k: v for k, v in env.items() if k in ("NATS_URL", "INFERBUS_ZONE_FILE")})
        accounts = server_config(nkeys.from_seed(seed).public_key.decode(), CALLOUT_ACCOUNT, "auth", auth_password,
                                 (("ops", ops.password),))
        return lambda node_config: node_config.split("accounts {")[0] + accounts

    def _add(self, name: str, argv: list[str], ready: Callable[[], bool], detail: str = "", **env: str) -> Process:
        env = {**self.credentials(name), **env}
        process = Process(name, argv, self._env(**env), self.config.state_dir / "logs" / f"{name}.log", ready, detail)
        self.processes.append(process)
        return process

    def _inferbus(self, *args: str) -> list[str]:
        return [sys.executable, "-m", "tools.commands.main", *args]

    def plan(self) -> None:
        c = self.config
        private_dir(c.state_dir)
        self.model_dir = self.resolve_model_dir()
        if c.tls and self.nats_server_url:
            raise ValueError("TLS applies to the NATS the platform starts; for your own (NATS_URL), configure "
                             "TLS on that server and set NATS_TLS_CA")
        if c.zones > 1:
            self._plan_zones()
            return
        if not self.nats_server_url:
            port, monitor = free_port(), free_port()
            scheme = "tls" if c.tls else "nats"
            self.nats_server_url = f"{scheme}://127.0.0.1:{port}"
            workers = [] if c.autoscale else [f"worker-{i}" for i in range(1, c.workers + 1)]
            self.identities = LocalIdentities(GATEWAY_ID, BATCH_SERVICE_ID, workers)
            ops = self.identities["ops"]
            self.nats_url = f"{scheme}://{ops.user}:{ops.password}@127.0.0.1:{port}"
            tls = None
            if c.tls:
                from inferbus.local.tls import make_local_tls

                made = make_local_tls(c.state_dir / "tls")
                self.nats_tls_ca, tls = str(made.ca_file), (made.cert_file, made.key_file)
            self.nats_monitor_url = f"http://127.0.0.1:{monitor}"
            config = c.state_dir / "nats.conf"
            node_config = nats_config(port, monitor, c.state_dir / "nats", self.identities, tls)
            write_private(config, self._callout_setup()(node_config) if c.callout else node_config)
            self._add("nats", [nats_server_binary(), "-c", str(config)],
                      lambda: http_ok(f"http://127.0.0.1:{monitor}/healthz?js-enabled-only=true"), self.nats_server_url)
        if not self.redis_url:
            port = free_port()
            password = new_password()
            self.redis_url = f"redis://:{password}@127.0.0.1:{port}/0"
            config = c.state_dir / "redis.conf"
            write_private(config, redis_config(port, password, c.state_dir))
            self._add(
                "redis",
                [redis_server_binary(), str(config)],
                lambda: redis_reachable(self.redis_url),
                f"redis://127.0.0.1:{port}/0 (password in {config.name})",
            )
        if c.router:
            router_log = c.state_dir / "logs" / "router.log"
            # Readiness is its `router_ready` log line, so it logs at info at least (a few lines
            # per worker joining or leaving).
            level = c.log_level if c.log_level == "debug" else "info"
            self._add("router", self._inferbus("router"), lambda: logged(router_log, b'"router_ready"'), "",
                      INFERBUS_METRICS_PORT="0", INFERBUS_LOG_LEVEL=level)
        self._add("billing", self._inferbus("billing"), lambda: True, "reconciles usage", INFERBUS_METRICS_PORT="0")
        if c.batch:
            batch_log = c.state_dir / "logs" / "batch.log"
            # Readiness is its `batch_ready` log line, so it logs at info at least.
            ids = {"INFERBUS_BATCH_SERVICE_ID": BATCH_SERVICE_ID} if self.identities else {}
            self._add("batch", self._inferbus("batch"), lambda: logged(batch_log, b'"batch_ready"'),
                      "OpenAI Batch API on spare capacity", INFERBUS_METRICS_PORT="0", **ids,
                      INFERBUS_LOG_LEVEL=c.log_level if c.log_level == "debug" else "info")
        for i in range(1, 0 if c.autoscale else c.workers + 1):
            self.processes += replica_processes(i, c.engine_spec(), self._env(), c.state_dir / "logs",
                                                worker_env=self.credentials(f"worker-{i}"),
                                                kv_events="INFERBUS_ENGINE_KV_EVENTS" not in c.extra_env,
                                                role=c.role_of(i))
        admin = {"INFERBUS_ADMIN_KEY": c.admin_key} if c.admin_key else {}
        ids = {"INFERBUS_GATEWAY_ID": GATEWAY_ID} if self.identities else {}
        self._add("gateway", self._inferbus("gateway"), self.gateway_serving, self.gateway_url,
                  INFERBUS_GATEWAY_HOST=c.gateway_host, INFERBUS_GATEWAY_PORT=str(c.gateway_port), **admin, **ids)
        if c.autoscale:
            # Last, so that it stops first: it drains and stops the workers it started.
            autoscaler_log = c.state_dir / "logs" / "autoscaler.log"
            bounds = (f"{c.prefill}-{c.max_workers} prefill + {c.decode}-{c.max_workers} decode" if c.prefill
                      else f"{c.min_workers}-{c.max_workers}")
            self._add("autoscaler", self._inferbus("autoscaler"),
                      lambda: logged(autoscaler_log, b'"autoscaler_ready"'),
                      f"{bounds} workers, cold start {c.cold_start_s:g} s",
                      **self.autoscaler_env())

    def _plan_zones(self) -> None:
        """The multi-zone platform (see `inferbus.local.cluster`)."""
        from inferbus.local import cluster as lc
        from inferbus.runtime.redis_conn import sentinel_url

        c = self.config
        if c.nats_url or c.redis_url or c.autoscale:
            raise ValueError("zones > 1 runs its own NATS cluster and Redis with sentinels, without the autoscaler")
        self.zones = zones = lc.zone_names(c.zones)
        logs = c.state_dir / "logs"
        workers = [f"worker-{i}" for i in range(1, c.workers + 1)]
        self.identities = LocalIdentities(GATEWAY_ID, BATCH_SERVICE_ID, workers,
                                          gateways=[f"gateway-{z}" for z in zones])
        ops = self.identities["ops"]
        layout = lc.ClusterLayout(
            [lc.NatsNode(z, free_port(), free_port(), free_port()) for z in zones], new_password()
        )
        tls: tuple[Path, Path] | None = None
        route_tls: tuple[Path, Path, Path] | None = None
        if c.tls:  # one certificate for every node (all on loopback), on client ports and routes
            from inferbus.local.tls import make_local_tls

            made = make_local_tls(c.state_dir / "tls", client_auth=True)  # a route presents it as a client too
            self.nats_tls_ca, tls = str(made.ca_file), (made.cert_file, made.key_file)
            route_tls = (made.cert_file, made.key_file, made.ca_file)
        scheme = "tls" if c.tls else "nats"
        urls = [f"{scheme}://127.0.0.1:{node.port}" for node in layout.nodes]
        self.nats_urls = [f"{scheme}://{ops.user}:{ops.password}@127.0.0.1:{node.port}" for node in layout.nodes]
        self.nats_server_url = ",".join(urls)
        self.nats_url = ",".join(self.nats_urls)
        # Each service is told its zone as a Kubernetes pod is (INFERBUS_ZONE_FILE, inferbus.runtime.node_zone).
        for zone in zones:
            write_private(c.state_dir / "zones" / zone, zone + "\n")

        def zone_env(index: int) -> dict[str, str]:
            """A zone's services: its own NATS node first, its zone, R3; engines serve /fault
            (`inferbus drill` breaks GPUs through it)."""
            return {
                "NATS_URL": lc.preferred_first(urls, index),
                "INFERBUS_ZONE_FILE": str(c.state_dir / "zones" / zones[index]),
                "INFERBUS_JS_REPLICAS": str(len(zones)),
                "INFERBUS_SIM_FAULT_INJECTION": "true",
                # A hung GPU is given up after 5 s of no progress here (30 s by default): the
                # simulated engines run up to 10x real time, and drills are bounded.
                "INFERBUS_WORKER_ENGINE_HANG_AFTER_S": os.environ.get("INFERBUS_WORKER_ENGINE_HANG_AFTER_S", "5"),
            }

        with_callout = self._callout_setup([zone_env(i) for i in range(len(zones))]) if c.callout else None
        for node, url in zip(layout.nodes, urls, strict=True):
            config = c.state_dir / f"nats-{node.zone}.conf"
            node_config = nats_config(
                node.port, node.monitor_port, c.state_dir / f"nats-{node.zone}", self.identities, tls
            )
            if with_callout is not None:
                node_config = with_callout(node_config)
            write_private(config, node_config + "\n" + lc.nats_cluster_block(layout, node, route_tls) + "\n")
            self._add(f"nats-{node.zone}", [nats_server_binary(), "-c", str(config)],
                      partial(http_ok, f"http://127.0.0.1:{node.monitor_port}/healthz"), url)
        # Redis: the primary in the first zone, a replica in the second, a sentinel in each.
        password = new_password()
        primary_port, replica_port = free_port(), free_port()
        for zone, port, primary in ((zones[0], primary_port, None), (zones[1], replica_port, primary_port)):
            data_dir = c.state_dir / f"redis-{zone}"
            private_dir(data_dir)
            config = c.state_dir / f"redis-{zone}.conf"
            write_private(
                config, redis_config(port, password, data_dir) + lc.redis_replication_lines(password, primary)
            )
            url = f"redis://:{password}@127.0.0.1:{port}/0"
            self._add(f"redis-{zone}", [redis_server_binary(), str(config)], partial(redis_reachable, url),
                      f"redis://127.0.0.1:{port}/0 ({'replica' if primary else 'primary'})")
        sentinels = []
        for zone in zones:
            port = free_port()
            sentinels.append(("127.0.0.1", port))
            config = c.state_dir / f"sentinel-{zone}.conf"
            write_private(config, lc.sentinel_config(port, primary_port, password, c.state_dir))
            url = f"redis://:{password}@127.0.0.1:{port}/0"
            self._add(f"sentinel-{zone}", [redis_server_binary(), str(config), "--sentinel"],
                      partial(redis_reachable, url), f"127.0.0.1:{port}")
        self.redis_url = sentinel_url(sentinels, lc.SENTINEL_SERVICE, password)
        level = c.log_level if c.log_level == "debug" else "info"
        for index, zone in enumerate(zones):
            router_log = logs / f"router-{zone}.log"
            self._add(f"router-{zone}", self._inferbus("router"), partial(logged, router_log, b'"router_ready"'),
                      f"zone {zone}", INFERBUS_METRICS_PORT="0", INFERBUS_LOG_LEVEL=level, **zone_env(index))
        self._add("billing", self._inferbus("billing"), lambda: True, "reconciles usage", INFERBUS_METRICS_PORT="0",
                  **zone_env(0))
        if c.batch:
            batch_log = logs / "batch.log"
            self._add("batch", self._inferbus("batch"), lambda: logged(batch_log, b'"batch_ready"'),
                      "OpenAI Batch API on spare capacity", INFERBUS_METRICS_PORT="0",
                      INFERBUS_BATCH_SERVICE_ID=BATCH_SERVICE_ID, INFERBUS_LOG_LEVEL=level, **zone_env(0))
        for i in range(1, c.workers + 1):
            index = zones.index(lc.worker_zone(i, zones))
            engine, worker = replica_processes(i, c.engine_spec(), self._env(**zone_env(index)), logs,
                                               worker_env=self.credentials(f"worker-{i}"),
                                               kv_events="INFERBUS_ENGINE_KV_EVENTS" not in c.extra_env,
                                               role=c.role_of(i))
            worker.detail += f", zone {zones[index]}"
            self.processes += [engine, worker]
        admin = {"INFERBUS_ADMIN_KEY": c.admin_key} if c.admin_key else {}
        for index, zone in enumerate(zones):
            port = c.gateway_port if index == 0 else free_port()
            url = f"http://{c.gateway_host}:{port}"
            self.gateway_urls[zone] = url
            self._add(f"gateway-{zone}", self._inferbus("gateway"), partial(self.gateway_serving, url), url,
                      INFERBUS_GATEWAY_HOST=c.gateway_host, INFERBUS_GATEWAY_PORT=str(port),
                      INFERBUS_GATEWAY_ID=f"gateway-{zone}", **admin, **zone_env(index))
        self.gateway_url = self.gateway_urls[zones[0]]

    def resolve_model_dir(self) -> str:
        """The configured model directory, or a small one written under the state directory (a
        tokenizer trained on local text, cached between runs: seconds the first time)."""
        if self.config.model_dir is not None:
            return str(self.config.model_dir)
        if os.environ.get("INFERBUS_MODEL_DIR"):
            return os.environ["INFERBUS_MODEL_DIR"]
        from inferbus.tokens.modeldir import build_model_dir

        built = build_model_dir(self.config.state_dir / "model", self.config.chat_format)
        make_private_tree(built)
        return str(built)

    def autoscaler_env(self) -> dict[str, str]:
        """The local actuator's settings (`stack_config.autoscaler_env`)."""
        worker = self.identities["worker"] if self.identities else None
        return autoscaler_env(self.config, worker, os.environ)

    def start(self, on_status: Callable[[Process, str], None] = lambda p, s: None, timeout: float = 60.0) -> None:
        """Start everything; services that need NATS/Redis wait for them to be ready first."""
        self.plan()
        for wave in range(START_WAVES):
            group = [p for p in self.processes if start_wave(p.name) == wave]
            for process in group:
                process.start()
                process.backoff.started_at = time.monotonic()
                on_status(process, "starting")
            self._wait_ready(group, on_status, timeout)
        self.write_platform_file()

    def platform_file(self) -> dict[str, object]:
        """Where the platform is and how the operator reaches it: read by the `inferbus` CLI."""
        ops = self.identities["ops"] if self.identities else None
        return {
            "launcher_pid": os.getpid(), "gateway_url": self.gateway_url, "admin_key": self.config.admin_key,
            "nats_url": self.nats_server_url, "nats_user": ops.user if ops else "",
            "nats_password": ops.password if ops else "", "nats_tls_ca": self.nats_tls_ca, "redis_url": self.redis_url,
            "processes": {p.name: p.pid for p in self.processes},
            "zones": self.zones, "gateway_urls": self.gateway_urls,
            "details": {p.name: p.detail for p in self.processes}, "export_dir": str(self.export_dir),
        }

    @property
    def export_dir(self) -> Path:
        """Where the billing service (and `inferbus usage export-month`) write monthly exports."""
        return (self.config.state_dir / "exports").absolute()

    def write_platform_file(self) -> None:
        write_private(self.config.state_dir / PLATFORM_FILE, json.dumps(self.platform_file(), indent=2) + "\n")

    def supervise(self, on_status: Callable[[Process, str], None] = lambda p, s: None,
                  now: Callable[[], float] = time.monotonic) -> None:
        """Restart every process that exited, each on its own backoff; call it every fraction of a
        second. NATS comes back on the same port and store (services reconnect by themselves)."""
        changed = False
        for process in self.processes:
            if process.alive():
                continue
            if process.backoff.exited_at is None:
                wait = process.backoff.exited(now())
                on_status(process, f"exited (code {process.returncode}), restarting in {wait:.0f} s")
                self._replace_engine_of(process, on_status)
            if process.backoff.due(now()):
                process.start()
                process.backoff.restarted(now())
                changed = True
                on_status(process, f"restarted (restart {process.backoff.restarts} in a row)")
        if changed:
            self.write_platform_file()

    def _replace_engine_of(self, worker: Process, on_status: Callable[[Process, str], None]) -> None:
        """A worker that gave its GPU up (exit EXIT_GPU_DEATH) is replaced with its engine: the
        engine process is killed here and both restart (a new pod, in Kubernetes)."""

        if not worker.name.startswith("worker-") or worker.returncode != EXIT_GPU_DEATH:
            return
        engine = next((p for p in self.processes if p.name == "engine-" + worker.name.split("-", 1)[1]), None)
        if engine is not None and engine.alive():
            on_status(engine, "replaced (its worker reported GPU death)")
            engine.signal(signal.SIGKILL)
            engine.wait(5)

    def _wait_ready(self, group: list[Process], on_status: Callable[[Process, str], None], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        pending = list(group)
        restarts: dict[str, int] = {}
        while pending:
            for process in list(pending):
                if not process.alive():
                    if not restart_in_start_up(process.name, restarts.get(process.name, 0)):
                        raise RuntimeError(f"{process.name} exited during start-up:\n{process.tail()}")
                    restarts[process.name] = restarts.get(process.name, 0) + 1
                    on_status(process, f"exited during start-up (code {process.returncode}), starting it again")
                    process.start()
                    continue
                if process.ready():
                    pending.remove(process)
                    on_status(process, "ready")
            if pending and time.monotonic() > deadline:
                names = ", ".join(p.name for p in pending)
                raise RuntimeError(f"not ready after {timeout:.0f} s: {names}\n" + "\n".join(p.tail() for p in pending))
            time.sleep(0.1)

    def gateway_serving(self, url: str | None = None) -> bool:
        """The gateway (at `url`, default the platform's) is up, connected, and sees every worker's heartbeat."""
        needed = self.config.serving_workers_needed()
        try:
            with urllib.request.urlopen(f"{url or self.gateway_url}/ready", timeout=2) as response:
                return json.load(response).get("workers", 0) >= needed
        except urllib.error.HTTPError as error:  # 503 until a worker is ready: its body still counts them
            try:
                body = json.load(error)
            except ValueError:
                return False
            return needed == 0 and body.get("problems") == ["no_workers"]
        except Exception:
            return False

    def get(self, name: str) -> Process:
        return next(p for p in self.processes if p.name == name)

    def stop(self, timeout: float = 15.0) -> None:
        (self.config.state_dir / PLATFORM_FILE).unlink(missing_ok=True)
        # Reverse order: gateway and workers drain while NATS is still up.
        for process in reversed(self.processes):
            process.signal(signal.SIGTERM)
            if not process.wait(stop_grace_s(process.name, timeout)):
                process.signal(signal.SIGKILL)
                process.wait(5)
        remove_secrets(self.config.state_dir)  # no process is left to read them

    def rmtree(self) -> None:
        shutil.rmtree(self.config.state_dir, ignore_errors=True)
