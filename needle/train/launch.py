"""One fine-tune on N Ray workers, as one SPMD program (``needle/train/distributed.py``).

Each worker is a Ray actor holding ``devices_per_worker`` devices (GPUs it reserves; on CPU as
many virtual devices). Worker 0 picks the coordinator address; every worker joins the
``jax.distributed`` group and calls the same ``run_training`` on the same prepared data (read
from its saved directory) into the same ``out_dir``, which must be a path every worker reaches
(one machine, or a shared filesystem). Worker 0's result comes back; the caller logs it, so
only the orchestrator talks to a tracker. Ray Train's ``JaxTrainer`` is not used: in Ray 2.60 it
sets up ``jax.distributed`` only for TPU and GPU workers.

A worker that dies ends the run: the others' collectives fail or their heartbeat runs out
(``distributed.HEARTBEAT_S``), every actor is killed and ``WorkerFailedError`` names the
worker and the reason. Checkpoints stay, so the same call again resumes.

    result = train_on_workers(spec, ClusterConfig(workers=2))   # a local Ray, started and stopped
    result = train_on_workers(spec, ClusterConfig(workers=8, address="head:6379", devices_per_worker=1))
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from needle.config import ClusterConfig, LoraConfig, ModelConfig, OptimConfig, TrainConfig
from needle.data.prepare import load_cached
from needle.errors import NeedleError
from needle.train.distributed import ProcessGroup, free_port, initialize, is_primary
from needle.train.run import run_training

log = logging.getLogger(__name__)


class WorkerFailedError(NeedleError, RuntimeError):
    """A Ray worker of a multi-process fine-tune died or raised; the run is over, its checkpoints stay."""


@dataclass(frozen=True)
class TrainSpec:
    """What every worker trains: plain paths and configs, the same for all of them."""

    prepared_dir: str  # a directory written by needle.data.prepare.save_cached
    model_cfg: ModelConfig
    train_cfg: TrainConfig
    optim_cfg: OptimConfig
    lora_cfg: LoraConfig | None
    base_model_dir: str | None  # None: from scratch
    out_dir: str  # shared by all workers: checkpoints, the exported model


class _Worker:
    """A Ray actor: one process of the group."""

    def coordinator(self, host: str | None) -> str:
        """host:port for the group's coordination service, on this (worker 0's) node."""
        import ray

        host = host or ray.util.get_node_ip_address()
        return f"{host}:{free_port(host)}"

    def train(self, spec: TrainSpec, coordinator: str, workers: int, rank: int) -> Any:
        """Join the group and run ``run_training``; the result (worker 0) or None."""
        if rank == 0:  # worker 0's progress reaches the driver's console (Ray forwards actor output)
            handler = logging.StreamHandler()
            handler.setFormatter(logging.Formatter("%(asctime)s %(name)s: %(message)s", "%H:%M:%S"))
            needle_log = logging.getLogger("needle")
            needle_log.addHandler(handler)
            needle_log.setLevel(logging.INFO)
            needle_log.propagate = False  # Ray's root handler would print each line twice
        initialize(ProcessGroup(coordinator, workers, rank))
        loaded = load_cached(spec.prepared_dir)
        if loaded is None:
            raise FileNotFoundError(f"{spec.prepared_dir}: no prepared data (save_cached writes it)")
        prepared, tokenizer = loaded
        result = run_training(
            prepared, tokenizer, spec.model_cfg, spec.train_cfg, spec.optim_cfg, spec.lora_cfg,
            base_model_dir=spec.base_model_dir, out_dir=spec.out_dir,
        )  # fmt: skip
        if not is_primary():
            return None
        import ray

        # Which node trained it (worker 0's): a sweep's trials spread over the cluster's nodes.
        result.params["cluster.node"] = ray.get_runtime_context().get_node_id()[:12]
        return result


def _worker_options(cluster: ClusterConfig) -> dict[str, Any]:
    env = {k: os.environ[k] for k in ("JAX_PLATFORMS",) if k in os.environ}
    if os.environ.get("JAX_PLATFORMS", "cpu").startswith("cpu"):
        env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={cluster.devices_per_worker}"
        return {"num_cpus": 1, "runtime_env": {"env_vars": env}}
    return {"num_cpus": 1, "num_gpus": cluster.devices_per_worker, "runtime_env": {"env_vars": env}}


def ray_address(cluster: ClusterConfig) -> str | None:
    """The cluster to join: ``cluster.address``, else ``$RAY_ADDRESS`` (Ray's own variable, which
    deployments/stack-up.sh sets for its worker's flow runs), else None (a local Ray for the run)."""
    return cluster.address or os.environ.get("RAY_ADDRESS") or None


def connect_ray(cluster: ClusterConfig) -> bool:
    """Connect to the cluster's address or start a local Ray on 127.0.0.1; True when started here."""
    address = ray_address(cluster)
    if not address:
        # A local Ray for this run only: every listener on loopback (Ray's own single-machine
        # mode, named for macOS and Windows; read when ray is first imported).
        os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    import ray

    if ray.is_initialized():
        return False
    if address:
        ray.init(address=address, log_to_driver=True)
        return False
    # address="local": a new instance even when a `ray start` cluster ran on this machine (without
    # it ray.init joins the cluster named in /tmp/ray/ray_current_cluster, and refuses num_cpus).
    ray.init(address="local", num_cpus=cluster.workers, include_dashboard=False, log_to_driver=True)
    return True


def train_on_workers(spec: TrainSpec, cluster: ClusterConfig) -> Any:
    """Run ``spec`` on ``cluster.workers`` Ray workers as one program; worker 0's ``TrainResult``."""
    Path(spec.out_dir).mkdir(parents=True, exist_ok=True)
    address = ray_address(cluster)
    started = connect_ray(cluster)
    import ray

    actor_cls = ray.remote(_Worker)
    actors = [actor_cls.options(**_worker_options(cluster)).remote() for _ in range(cluster.workers)]
    try:
        coordinator = ray.get(actors[0].coordinator.remote(None if address else "127.0.0.1"))
        log.info("training on %d Ray workers (coordinator %s)", cluster.workers, coordinator)
        refs = [a.train.remote(spec, coordinator, cluster.workers, rank) for rank, a in enumerate(actors)]
        results: dict[int, Any] = {}
        pending = list(refs)
        while pending:
            done, pending = ray.wait(pending, num_returns=1)
            rank = refs.index(done[0])
            try:
                results[rank] = ray.get(done[0])
            except Exception as err:  # noqa: BLE001 - any worker failure ends the run, named
                reason = str(err).strip().splitlines()
                raise WorkerFailedError(
                    f"worker {rank} of {cluster.workers} failed: {reason[-1] if reason else type(err).__name__}; "
                    f"checkpoints in {spec.out_dir} are kept, run again to resume"
                ) from None
        # Where it ran, beside worker 0's cluster.node: the address, or "local" for a Ray of this run.
        results[0].params.update({"cluster.workers": cluster.workers, "cluster.ray": address or "local"})
        return results[0]
    finally:
        for actor in actors:
            ray.kill(actor)
        if started:
            ray.shutdown()
