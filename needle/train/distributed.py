"""One training program across several processes (and hosts) with ``jax.distributed``.

Every process runs the same code on the same prepared data: ``initialize`` joins the group
(on CPU over the gloo collectives), after which ``jax.devices()`` lists every process's devices
and the mesh of ``needle/train/sharding.py`` spans them all. Each process puts on its own
devices only its part of each batch and of each sharded leaf; collectives do the rest. Only
process 0 writes the exported model and talks to a tracker (``is_primary``); the others log
nothing. A process that dies ends the others' collectives with an error within
``heartbeat_s`` (no hang).

    group = ProcessGroup(coordinator="127.0.0.1:8476", num_processes=2, process_id=rank)
    initialize(group)          # before any other JAX call of the process
    ...                        # run_training as in one process
"""

from __future__ import annotations

import socket
from dataclasses import dataclass

import jax

# Seconds a process waits for the others to join, and without a heartbeat before it declares
# a peer dead (JAX's defaults are 300 s and 100 s: too long for a run that should fail fast).
JOIN_TIMEOUT_S = 120
HEARTBEAT_S = 20


@dataclass(frozen=True)
class ProcessGroup:
    """Where the processes of one program meet and which one this is."""

    coordinator: str  # host:port of process 0's coordination service
    num_processes: int  # processes in the program
    process_id: int  # this process, 0 .. num_processes - 1

    def __post_init__(self) -> None:
        if self.num_processes < 1 or not 0 <= self.process_id < self.num_processes:
            raise ValueError(f"process_id={self.process_id} is not in 0..{self.num_processes - 1}")


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` now (for the coordinator)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def initialize(group: ProcessGroup, *, heartbeat_s: int = HEARTBEAT_S) -> None:
    """Join ``group``: gloo collectives on CPU, then ``jax.distributed.initialize``. One process: nothing to join."""
    if group.num_processes == 1:
        return
    # Only the CPU client reads it; on GPU and TPU their own collectives are used.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=group.coordinator, num_processes=group.num_processes, process_id=group.process_id,
        initialization_timeout=JOIN_TIMEOUT_S, heartbeat_timeout_seconds=heartbeat_s,
    )  # fmt: skip


def is_primary() -> bool:
    """Whether this is process 0, the one that writes shared files and reports."""
    return jax.process_index() == 0
