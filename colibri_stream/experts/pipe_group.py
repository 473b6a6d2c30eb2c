"""An expert-parallel group's collectives between processes of one host, over pipes (the CPU's `Communicator`).

`pipe_mesh(N)` makes one duplex pipe per pair of ranks (in the process that spawns the ranks); each rank builds a
`PipeCommunicator` from its ends. A collective posts one pickled message to each peer, on a thread of its own so
that two ranks sending each other large messages never wait on each other's full pipe, and reads one message from
each peer. Every pair's messages come in the order they were sent, and every rank calls the same collectives in
the same order, so a message is always the one its reader expects.

A peer that dies closes its ends: the next read from it ends the collective at once with ExpertParallelError; a
peer silent past `timeout` seconds does the same. A failed communicator stays failed (the ranks no longer agree on
which collective comes next), and `abort` closes its pipes so that its peers fail at once as well.
"""

from __future__ import annotations

import threading
import time
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from ..errors import ExpertParallelError
from .expert_parallel import Communicator

COLLECTIVE_TIMEOUT_SECONDS = 300.0  # how long a rank waits for a peer's message inside a collective: the slowest
#                                     peer's work between two collectives (one layer of a long prefill) fits in it


def pipe_mesh(size: int, context: Any) -> list[dict[int, Connection]]:
    """One duplex pipe per pair of `size` ranks (context: a multiprocessing context): mesh[r][p] is rank r's end
    of its pipe to rank p. The spawning process hands each rank its own dict and then closes its copies."""
    mesh: list[dict[int, Connection]] = [{} for _ in range(size)]
    for low in range(size):
        for high in range(low + 1, size):
            mesh[low][high], mesh[high][low] = context.Pipe(duplex=True)
    return mesh


class PipeCommunicator(Communicator):
    """Rank `rank`'s collectives over its pipes to every peer (`pipe_mesh`), on host NumPy arrays."""

    def __init__(self, rank: int, peers: dict[int, Connection], timeout: float = COLLECTIVE_TIMEOUT_SECONDS):
        self.rank, self.size = rank, len(peers) + 1
        if sorted(peers) != [r for r in range(self.size) if r != rank]:
            raise ValueError(f"rank {rank} needs a pipe to each other rank of {self.size}, got {sorted(peers)}")
        self._peers = peers
        self.timeout = timeout
        self._failure: str | None = None

    def all_to_all(self, sends: list[np.ndarray]) -> list[np.ndarray]:
        received = self._exchange({peer: sends[peer] for peer in self._peers})
        return [np.array(sends[r]) if r == self.rank else received[r] for r in range(self.size)]

    def all_gather(self, part: np.ndarray) -> list[np.ndarray]:
        received = self._exchange(dict.fromkeys(self._peers, part))
        return [np.array(part) if r == self.rank else received[r] for r in range(self.size)]

    def reduce_scatter(self, parts: list[np.ndarray]) -> np.ndarray:
        received = self._exchange({peer: parts[peer] for peer in self._peers})
        received[self.rank] = parts[self.rank]
        total = np.array(received[0])
        for r in range(1, self.size):  # in rank order, as FakeGroup adds them
            total += received[r]
        return total

    def broadcast(self, obj: Any, root: int = 0) -> Any:
        received = self._exchange(dict.fromkeys(self._peers, obj if self.rank == root else None))
        return obj if self.rank == root else received[root]

    def abort(self, reason: str) -> None:
        """Fail this communicator and close its pipes: every peer's next collective fails at once."""
        if self._failure is None:
            self._failure = reason
        for connection in self._peers.values():
            connection.close()

    def _exchange(self, posts: dict[int, Any]) -> dict[int, Any]:
        """Send posts[peer] to every peer and return what each peer sent this rank."""
        if self._failure is not None:
            raise ExpertParallelError(f"the expert-parallel group failed earlier: {self._failure}")
        send_error: list[BaseException] = []
        sender = threading.Thread(target=self._send_all, args=(posts, send_error), name="colibri-group-send",
                                  daemon=True)  # left blocked on a peer that stopped reading, it holds no lock
        sender.start()
        deadline = time.monotonic() + self.timeout
        received = {peer: self._receive(peer, deadline) for peer in sorted(self._peers)}
        sender.join(max(0.0, deadline - time.monotonic()))
        if sender.is_alive() or send_error:
            why = "timed out" if sender.is_alive() else f"failed: {send_error[0]!r}"
            self._fail(f"sending to the peers of rank {self.rank} {why}")
        return received

    def _send_all(self, posts: dict[int, Any], errors: list[BaseException]) -> None:
        for peer, post in posts.items():
            try:
                self._peers[peer].send(post)
            except (OSError, ValueError) as error:  # a closed pipe: its reader reports the peer
                errors.append(error)
                return

    def _receive(self, peer: int, deadline: float) -> Any:
        connection = self._peers[peer]
        try:
            if not connection.poll(max(0.0, deadline - time.monotonic())):
                self._fail(f"rank {peer} sent nothing for {self.timeout:g} s")
            return connection.recv()
        except (EOFError, OSError):
            self._fail(f"rank {peer} is gone (its pipe to rank {self.rank} closed)")

    def _fail(self, reason: str) -> None:
        self.abort(reason)
        raise ExpertParallelError(f"expert-parallel collective failed: {reason}")
