"""The local stack: Prefect server (SQLite under PREFECT_HOME), work pool, deployments, process worker;
optionally an MLflow server with its artifacts on S3 and, for local testing, moto's S3 server.

    python -m tools.stack up       # what `make stack-up` runs; idempotent
    python -m tools.stack up --with-s3 --mlflow   # `make stack-up-s3`: + moto S3 on loopback + MLflow server
    python -m tools.stack down     # worker first (SIGINT), then MLflow, the Prefect server, S3
    python -m tools.stack status
    python -m tools.stack run --phase phase7   # prefect deployment run 'train-phase/phase7' --watch

``--with-s3`` starts ``moto`` on 127.0.0.1:``--s3-port``, gives the stack's processes moto's dummy
credentials and ``AWS_ENDPOINT_URL`` (boto3, DVC and MLflow all honour it), creates the buckets and,
when params.yaml names no ``storage.dvc_remote``, makes ``s3://sdforge/dvcstore`` the default DVC
remote in ``.dvc/config.local``. Without it, S3 is whatever the AWS chain of this shell reaches.
``--mlflow`` starts ``mlflow server --artifacts-destination <storage.mlflow_artifacts>`` (credentials
on the server side only; clients need just ``MLFLOW_TRACKING_URI``, which the worker gets).

Pid files, logs and an ``env`` file to ``source`` live in ``.stack/`` (git-ignored). The tests
start the same stack on a free port against a temporary project.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from flows.dvc_ops.remote import configure_remote
from sdforge.config import load_params
from sdforge.training.s3_checkpoints import split_s3_url

ROOT = Path(__file__).resolve().parent.parent
POOL = "local-process"
FLOW = "train-phase"
LOCAL_BUCKET = "sdforge"
"""The bucket ``--with-s3`` creates when params.yaml names none."""
MOTO_CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing"}
"""moto accepts any credentials; these dummies are set only when the shell has none."""
PROCESS_MARKERS = {"server": b"prefect", "worker": b"prefect", "mlflow": b"mlflow", "s3": b"moto"}
"""What the command line of each stack process contains (a pid file whose pid was reused is ignored)."""

OFFLINE_ENV = {
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "DO_NOT_TRACK": "1",
    "DVC_NO_ANALYTICS": "1",
    "NO_ALBUMENTATIONS_UPDATE": "1",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "WANDB_MODE": "disabled",
}


class StackError(RuntimeError):
    pass


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie is dead for our purposes
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        return state != "Z"
    except (OSError, IndexError):
        return True


def _wait_dead(pid: int, timeout_s: float, proc: subprocess.Popen | None) -> bool:
    if proc is not None:
        try:
            proc.wait(timeout=timeout_s)
            return True
        except subprocess.TimeoutExpired:
            return False
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not _alive(pid):
            return True
        time.sleep(0.2)
    return not _alive(pid)


def stop_process(pid: int, grace_s: float, proc: subprocess.Popen | None = None) -> None:
    """SIGINT ``pid`` (a graceful Prefect shutdown), then SIGTERM / SIGKILL its process group.

    Every process the stack starts leads its own session, so the group is its own.
    """
    try:
        os.kill(pid, signal.SIGINT)
    except ProcessLookupError:
        pass
    if not _wait_dead(pid, grace_s, proc):
        try:
            os.killpg(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        if not _wait_dead(pid, 5.0, proc):
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            _wait_dead(pid, 5.0, proc)
    try:  # leftovers in the group (a flow run the worker started, uvicorn under the server)
        os.killpg(pid, signal.SIGTERM)
    except ProcessLookupError:
        pass


def _restore_sigint() -> None:
    # A shell's background job starts with SIGINT ignored, and an ignored signal stays ignored
    # across exec; the worker must see SIGINT to shut down cleanly.
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@dataclass
class Stack:
    root: Path = ROOT
    """Project root: where `prefect deploy` reads prefect.yaml; exported as SDFORGE_ROOT."""
    home: Path = field(default_factory=lambda: Path(os.environ.get("PREFECT_HOME", ROOT / ".prefect")))
    state_dir: Path = ROOT / ".stack"
    host: str = "127.0.0.1"
    port: int = 4200
    pool: str = POOL
    query_seconds: float = 2.0
    with_s3: bool = False
    s3_port: int = 5900
    with_mlflow: bool = False
    mlflow_port: int = 5000
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)

    @property
    def api_url(self) -> str:
        return f"http://{self.host}:{self.port}/api"

    @property
    def s3_endpoint(self) -> str:
        return f"http://{self.host}:{self.s3_port}"

    @property
    def mlflow_url(self) -> str:
        return f"http://{self.host}:{self.mlflow_port}"

    def storage(self):
        """params.yaml's ``storage:`` section, with ``--with-s3``'s local defaults filled in."""
        storage = load_params(self.root / "params.yaml").storage
        if self.with_s3:
            storage = storage.model_copy(update={
                "dvc_remote": storage.dvc_remote or f"s3://{LOCAL_BUCKET}/dvcstore",
                "mlflow_artifacts": storage.mlflow_artifacts or f"s3://{LOCAL_BUCKET}/mlflow",
            })
        return storage

    def env(self) -> dict[str, str]:
        """Environment of every process of the stack (and of the flow runs the worker starts)."""
        env = dict(os.environ)
        env.update(OFFLINE_ENV)
        env.update(
            PREFECT_HOME=str(self.home),
            PREFECT_API_URL=self.api_url,
            PREFECT_WORKER_QUERY_SECONDS=f"{self.query_seconds:g}",
            SDFORGE_ROOT=str(self.root),
            PATH=os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")]),
            PYTHONUNBUFFERED="1",
        )
        if self.with_s3:
            env["AWS_ENDPOINT_URL"] = self.s3_endpoint
            env.setdefault("AWS_DEFAULT_REGION", "us-east-1")
            if not env.get("AWS_ACCESS_KEY_ID"):
                env.update(MOTO_CREDENTIALS)
        if self.with_mlflow:
            env["MLFLOW_TRACKING_URI"] = self.mlflow_url
        return env

    def prefect(self, *args: str, check: bool = True, capture: bool = True) -> subprocess.CompletedProcess:
        """Run the ``prefect`` CLI against this stack, in the project root."""
        proc = subprocess.run(
            [sys.executable, "-m", "prefect", *args],
            cwd=self.root, env=self.env(), text=True, capture_output=capture, stdin=subprocess.DEVNULL,
        )
        if check and proc.returncode != 0:
            out = (proc.stdout or "") + (proc.stderr or "")
            raise StackError(f"prefect {' '.join(args)} exited {proc.returncode}:\n{out[-4000:]}")
        return proc

    # --- processes ---------------------------------------------------------------------------------

    def _pidfile(self, name: str) -> Path:
        return self.state_dir / f"{name}.pid"

    def pid(self, name: str) -> int | None:
        """The pid of a running ``name`` (server / worker) from its pid file, else None."""
        try:
            pid = int(self._pidfile(name).read_text().strip())
        except (OSError, ValueError):
            return None
        if not _alive(pid):
            return None
        try:
            if PROCESS_MARKERS.get(name, b"prefect") not in Path(f"/proc/{pid}/cmdline").read_bytes():
                return None  # pid reused by something else
        except OSError:
            pass
        return pid

    def _spawn(self, name: str, *args: str, module: str = "prefect", env: dict[str, str] | None = None) -> int:
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self.home.mkdir(parents=True, exist_ok=True)
        log = (self.state_dir / f"{name}.log").open("ab")
        proc = subprocess.Popen(
            [sys.executable, "-m", module, *args],
            cwd=self.root, env=env or self.env(), stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True, preexec_fn=_restore_sigint,
        )
        log.close()
        self.procs[name] = proc
        self._pidfile(name).write_text(f"{proc.pid}\n")
        return proc.pid

    def healthy(self, url: str | None = None) -> bool:
        try:
            with urllib.request.urlopen(url or f"{self.api_url}/health", timeout=2) as resp:
                return resp.status == 200
        except OSError:
            return False

    def _wait_healthy(self, name: str, pid: int, url: str, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not self.healthy(url):
            if not _alive(pid):
                raise StackError(f"{name} exited; see {self.state_dir / f'{name}.log'}")
            if time.monotonic() > deadline:
                raise StackError(f"{name} not healthy after {timeout_s:g} s; see {name}.log")
            time.sleep(0.5)

    def start_s3(self, timeout_s: float = 60.0) -> None:
        """moto's standalone S3 server on loopback (local testing only), then the buckets params name."""
        url = f"{self.s3_endpoint}/moto-api/"
        if not (self.pid("s3") and self.healthy(url)):
            if self.healthy(url):
                raise StackError(f"something else already serves {self.s3_endpoint}; pick another --s3-port")
            pid = self._spawn("s3", "-H", self.host, "-p", str(self.s3_port), module="moto.server")
            self._wait_healthy("s3", pid, url, timeout_s)
        self.ensure_buckets()

    def ensure_buckets(self) -> None:
        # lazy: boto3 (~0.5 s) only with --with-s3
        import boto3

        storage = self.storage()
        env = self.env()
        s3 = boto3.client(
            "s3", endpoint_url=self.s3_endpoint, region_name=env["AWS_DEFAULT_REGION"],
            aws_access_key_id=env["AWS_ACCESS_KEY_ID"], aws_secret_access_key=env.get("AWS_SECRET_ACCESS_KEY"),
        )
        for url in filter(None, (storage.dvc_remote, storage.mlflow_artifacts)):
            bucket = split_s3_url(url)[0]
            if bucket not in {b["Name"] for b in s3.list_buckets().get("Buckets", [])}:
                s3.create_bucket(Bucket=bucket)

    def configure_dvc_remote(self) -> None:
        configure_remote(self.root, self.storage())

    def start_mlflow(self, timeout_s: float = 90.0) -> None:
        """``mlflow server`` on loopback: runs in SQLite under .stack/, artifacts proxied to S3."""
        if self.pid("mlflow") and self.healthy(f"{self.mlflow_url}/health"):
            return
        dest = self.storage().mlflow_artifacts or str(self.state_dir / "mlartifacts")
        env = self.env()
        env["MLFLOW_SERVER_ENABLE_JOB_EXECUTION"] = "false"  # 0.55 GB instead of 2.7 GB RSS
        if env.get("AWS_ENDPOINT_URL"):
            env["MLFLOW_S3_ENDPOINT_URL"] = env["AWS_ENDPOINT_URL"]
        backend = f"sqlite:///{(self.state_dir / 'mlflow.db').resolve()}"
        pid = self._spawn(
            "mlflow", "server", "--host", self.host, "--port", str(self.mlflow_port), "--workers", "1",
            "--backend-store-uri", backend, "--artifacts-destination", dest, module="mlflow", env=env,
        )
        self._wait_healthy("mlflow", pid, f"{self.mlflow_url}/health", timeout_s)

    def start_server(self, timeout_s: float = 90.0) -> None:
        if self.pid("server") and self.healthy():
            print(f"prefect server already running (pid {self.pid('server')}) at {self.api_url}")
            return
        if self.healthy():
            raise StackError(f"something else already serves {self.api_url}; stop it or pick another port")
        pid = self._spawn("server", "server", "start", "--host", self.host, "--port", str(self.port))
        deadline = time.monotonic() + timeout_s
        while not self.healthy():
            if not _alive(pid):
                raise StackError(f"prefect server exited; see {self.state_dir / 'server.log'}")
            if time.monotonic() > deadline:
                raise StackError(f"prefect server not healthy after {timeout_s:g} s; see server.log")
            time.sleep(0.5)

    def ensure_pool(self) -> None:
        if self.prefect("work-pool", "inspect", self.pool, check=False).returncode != 0:
            self.prefect("work-pool", "create", self.pool, "--type", "process")

    def deploy(self, *names: str) -> None:
        """``prefect deploy`` from ``root/prefect.yaml``: every deployment, or ``names``."""
        selection = [a for n in names for a in ("--name", n)] or ["--all"]
        self.prefect("deploy", *selection, "--no-prompt")

    def start_worker(self) -> None:
        if self.pid("worker"):
            print(f"worker already running (pid {self.pid('worker')})")
            return
        self._spawn("worker", "worker", "start", "--pool", self.pool, "--type", "process")

    def write_env_file(self) -> Path:
        """``.stack/env``: the stack's URLs for a shell (never credentials: moto's dummies are its own)."""
        path = self.state_dir / "env"
        lines = [f"PREFECT_API_URL={self.api_url}", f"PREFECT_HOME={self.home}", f"SDFORGE_ROOT={self.root}"]
        if self.with_s3:
            lines.append(f"AWS_ENDPOINT_URL={self.s3_endpoint}")
        if self.with_mlflow:
            lines.append(f"MLFLOW_TRACKING_URI={self.mlflow_url}")
        path.write_text("".join(f"export {line}\n" for line in lines))
        return path

    def up(self, *deployments: str) -> None:
        t0 = time.monotonic()
        if self.with_s3:
            self.start_s3()
            self.configure_dvc_remote()
        if self.with_mlflow:
            self.start_mlflow()
        self.start_server()
        self.ensure_pool()
        self.deploy(*deployments)
        self.start_worker()
        self.write_env_file()
        print(f"stack up in {time.monotonic() - t0:.1f} s")

    def stop(self, name: str, grace_s: float) -> None:
        pid = self.pid(name)
        if pid is None:
            print(f"{name}: not running")
        else:
            stop_process(pid, grace_s, self.procs.get(name))
            print(f"{name}: stopped (pid {pid})")
        self._pidfile(name).unlink(missing_ok=True)
        self.procs.pop(name, None)

    def down(self) -> None:
        # Worker first and with SIGINT: a worker sent SIGTERM after its server died kept running.
        self.stop("worker", grace_s=20.0)
        for name in ("mlflow", "server", "s3"):
            if name == "server" or self.pid(name):
                self.stop(name, grace_s=15.0)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="local Prefect stack for sdforge")
    ap.add_argument("command", choices=["up", "down", "status", "run"])
    ap.add_argument("--port", type=int, default=int(os.environ.get("SDFORGE_PREFECT_PORT", "4200")))
    ap.add_argument("--phase", default="phase7", help="for `run`: the train-phase deployment")
    ap.add_argument("--with-s3", action="store_true", help="moto's S3 server on loopback (local testing)")
    ap.add_argument("--s3-port", type=int, default=int(os.environ.get("SDFORGE_S3_PORT", "5900")))
    ap.add_argument("--mlflow", action="store_true", help="MLflow server, artifacts to storage.mlflow_artifacts")
    ap.add_argument("--mlflow-port", type=int, default=int(os.environ.get("SDFORGE_MLFLOW_PORT", "5000")))
    args = ap.parse_args(argv)
    stack = Stack(
        port=args.port, with_s3=args.with_s3, s3_port=args.s3_port, with_mlflow=args.mlflow,
        mlflow_port=args.mlflow_port,
    )
    if args.command == "up":
        stack.up()
        if stack.with_s3:
            print(
                f"S3 (moto):   {stack.s3_endpoint}   DVC remote: {stack.storage().dvc_remote}\n"
                "             a shell without AWS credentials needs moto's dummies:"
                " export AWS_ACCESS_KEY_ID=testing AWS_SECRET_ACCESS_KEY=testing"
            )
        if stack.with_mlflow:
            print(f"MLflow UI:   {stack.mlflow_url}   artifacts: {stack.storage().mlflow_artifacts or 'local'}")
        print(
            f"Prefect UI:  http://{stack.host}:{stack.port}   (logs: {stack.state_dir}/server.log, worker.log)\n"
            f"In a shell:  source {stack.state_dir / 'env'}\n"
            f"             prefect deployment run '{FLOW}/phase7' --watch   (or: make run-phase PHASE=phase7)\n"
            "Stop:        make stack-down"
        )
    elif args.command == "down":
        stack.down()
    elif args.command == "status":
        for name in ("server", "worker", "mlflow", "s3"):
            pid = stack.pid(name)
            print(f"{name}: " + (f"running (pid {pid})" if pid else "not running"))
        print(f"api {stack.api_url}: {'healthy' if stack.healthy() else 'not answering'}")
    elif args.command == "run":
        if not stack.healthy():
            print("the stack is not up: run `make stack-up` first", file=sys.stderr)
            return 1
        run = stack.prefect("deployment", "run", f"{FLOW}/{args.phase}", "--watch", capture=False, check=False)
        return run.returncode
    return 0


if __name__ == "__main__":
    sys.exit(main())
