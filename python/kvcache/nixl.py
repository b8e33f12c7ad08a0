"""Disaggregated prefill and decode over NIXL: kvcache plans, NIXL moves.

A ``NixlLink`` is one rank's NIXL agent with its KV pool registered once
(the handshake's ``registrations``), and the peers it has met. Meeting a
peer exchanges two things in one message (``metadata()`` / ``add_peer()``):
NIXL's agent metadata and the rank's ``LayoutHandshake``; the handshakes are
checked (``LayoutMismatch`` names the field) and each side's prepared
descriptor list is built once (``prep_xfer_dlist``: one descriptor per plane
region and block, as vLLM's NixlConnector does). A read is then one
``make_prepped_xfer`` over the planner's descriptor ids, or, with
``coalesce=True``, one ``initialize_xfer`` of the coalesced address plan.

The PyPI wheels (``nixl``, ``nixl-cu12``, ``nixl-cu13``) ship the library and
this Python API but no C++ headers; NIXL is imported only when a link is
made. On a machine without RDMA, UCX runs over TCP: set ``UCX_TLS=tcp,self``
(and ``UCX_MODULES=^ib``: the wheel's bundled libnl crashes at exit without
it) before the first link.
"""

from __future__ import annotations

import struct
import time

import numpy as np

from ._kvcache import LayoutHandshake, TransferPlanner

_MEM = {"device": "VRAM", "pinned_host": "DRAM", "host": "DRAM"}


def _nixl():
    try:
        from nixl._api import nixl_agent, nixl_agent_config  # the "nixl" meta package
    except ImportError:
        try:
            from nixl_cu12 import nixl_agent, nixl_agent_config
        except ImportError:
            from nixl_cu13 import nixl_agent, nixl_agent_config
    return nixl_agent, nixl_agent_config


class NixlLink:
    """This rank's NIXL agent, its pool registered, and its peers.

    ``handshake``: this rank's ``LayoutHandshake`` (its ``engine_id`` names
    the agent unless ``name`` does). ``backend``: a NIXL backend ("UCX");
    ``backend_params``: its init parameters (``{"ucx_error_handling_mode":
    "none"}`` lets UCX use shared memory on one machine).
    """

    def __init__(self, handshake: LayoutHandshake, name: str | None = None, backend: str = "UCX",
                 backend_params: dict | None = None):
        nixl_agent, nixl_agent_config = _nixl()
        self.handshake = handshake
        self.name = name or handshake.engine_id
        self.agent = nixl_agent(self.name, nixl_agent_config(backends=[]))
        self.agent.create_backend(backend, backend_params or {})
        self._regs = [self.agent.register_memory([(addr, nbytes, dev, "")], _MEM[kind])
                      for addr, nbytes, dev, kind in handshake.registrations]
        self._local_mem = _MEM[handshake.memory]
        self._peers = {}

    def metadata(self) -> bytes:
        """What a peer's ``add_peer`` takes: NIXL's agent metadata and this rank's handshake."""
        md = self.agent.get_agent_metadata()
        return struct.pack("<Q", len(md)) + md + self.handshake.to_msgpack()

    def add_peer(self, metadata: bytes) -> str:
        """Meets a peer from its ``metadata()``: checks its layout against
        this rank's (``LayoutMismatch`` names the field) and prepares both
        sides' descriptor lists. Returns the peer's name."""
        (n,) = struct.unpack_from("<Q", metadata)
        md, hs = metadata[8:8 + n], metadata[8 + n:]
        remote = LayoutHandshake.from_msgpack(hs)
        planner = TransferPlanner(self.handshake, remote)  # raises on a mismatch, before NIXL meets the peer
        name = self.agent.add_remote_agent(md)
        key = name.decode() if isinstance(name, bytes) else name

        def descs(side):
            d = planner.dlist(side)
            out = np.empty((d.shape[0], 3), dtype=np.uint64)
            out[:, :2] = d
            out[:, 2] = (self.handshake if side else remote).device
            return out

        local = self.agent.prep_xfer_dlist("NIXL_INIT_AGENT", descs(True), self._local_mem)
        far = self.agent.prep_xfer_dlist(name, descs(False), _MEM[remote.memory])
        self._peers[key] = (name, remote, planner, local, far)
        return key

    def peer(self, name: str) -> LayoutHandshake:
        """The handshake a peer sent."""
        return self._peers[name][1]

    def read(self, peer: str, remote_blocks, local_blocks, *, group: int = 0, skip: int = 0, num_tokens: int = 0,
             window_only: bool = False, coalesce: bool = False, notify: bytes = b""):
        """Starts a NIXL READ of the peer's ``remote_blocks`` (its sequence's
        blocks from the first) into ``local_blocks`` (this rank's, from
        ``skip`` on: ``import_prompt``'s blocks and skip). ``notify`` reaches
        the peer when the read is done (it names the peer's hold). Returns the
        transfer handle (``wait`` / ``state``), or None when nothing is read."""
        name, remote, planner, local, far = self._peers[peer]
        if coalesce:
            plan = planner.plan(remote_blocks, local_blocks, group=group, skip=skip, num_tokens=num_tokens,
                                window_only=window_only)
            if len(plan) == 0:
                return None
            mine = np.empty((len(plan), 3), dtype=np.uint64)
            theirs = np.empty((len(plan), 3), dtype=np.uint64)
            mine[:, 0], mine[:, 1], mine[:, 2] = plan[:, 0], plan[:, 2], self.handshake.device
            theirs[:, 0], theirs[:, 1], theirs[:, 2] = plan[:, 1], plan[:, 2], remote.device
            handle = self.agent.initialize_xfer("READ", self.agent.get_xfer_descs(mine, self._local_mem),
                                                self.agent.get_xfer_descs(theirs, _MEM[remote.memory]), name, notify)
        else:
            lids, rids = planner.plan_ids(remote_blocks, local_blocks, group=group, skip=skip, num_tokens=num_tokens,
                                          window_only=window_only)
            if len(lids) == 0:
                return None
            handle = self.agent.make_prepped_xfer("READ", local, lids.astype(np.int32), far, rids.astype(np.int32), notify)
        state = self.agent.transfer(handle)
        if state == "ERR":
            raise RuntimeError(f"NIXL transfer to {peer} failed to start")
        return handle

    def state(self, handle) -> str:
        """"DONE", "PROC" or "ERR" (None, a read of nothing, is "DONE")."""
        return "DONE" if handle is None else self.agent.check_xfer_state(handle)

    def wait(self, handle, timeout: float) -> bool:
        """Polls until the read is done (True), fails or ``timeout`` seconds pass (False)."""
        end = time.monotonic() + timeout
        while True:
            s = self.state(handle)
            if s == "DONE":
                return True
            if s == "ERR" or time.monotonic() > end:
                return False
            time.sleep(0.0005)

    def notifications(self) -> dict:
        """New notifications by peer name: {name: [bytes, ...]}."""
        return {(k.decode() if isinstance(k, bytes) else k): v for k, v in self.agent.get_new_notifs().items()}

    def close(self):
        """Releases the prepared lists, forgets the peers, deregisters the pool."""
        for name, _, _, local, far in self._peers.values():
            local.release()
            far.release()
            self.agent.remove_remote_agent(name)
        self._peers.clear()
        for r in self._regs:
            self.agent.deregister_memory(r)
        self._regs = []
