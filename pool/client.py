"""FeatureClient: what a consumer process (an LLM prefill worker, a scheduler) uses to map
features out of a featpool producer without copying them.

    with FeatureClient.connect("/run/featpool/featpool.sock") as client:
        feats = client.open(lease)      # zero-copy tensor view; waits until the lease is ready
        ...                             # use feats (read-only)
        client.release(lease)           # ack: the producer recycles the memory

``lease`` is the descriptor the HTTP API returned (its JSON object, or a
``pool.descriptor.LeaseDescriptor``) or just its ``lease_id``.
On the GPU tier ``open`` and ``release`` are stream-ordered on the current CUDA stream: open
enqueues a wait on the lease's ready word, release enqueues the ack after your reads.

On another GPU of the node than the producer's (``device="cuda:3"``), ``open`` returns a view
that GPU reads in place over peer access (NVLink or PCIe) where the driver says it can, else a
copy in that GPU's memory, counted in ``client.fallbacks`` by reason (docs/protocol.md 9):

    client = FeatureClient.connect(sock, device="cuda:3")
    client.link          # producer_device, device, path: same_device | peer | copy, reason

From another node of a multi-node NVLink domain (the producer runs with ``--fabric-listen``):

    client = FeatureClient.connect("tcp://producer-host:7070", token=TOKEN)

maps the GPU tier through FABRIC handles and waits / acks on control words in the producer's
GPU memory. Such a client cannot read the host control block, so ``open`` cannot see on its own
that a lease ended before you read it: call ``is_current(lease)`` after reading (it asks the
producer) when the deadline could have passed.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Iterable, Mapping
from types import TracebackType
from typing import TYPE_CHECKING, Any, Protocol

import torch

from pool.backends.host_shm import HostSlab
from pool.control import AckBlock, ControlBlock, full_fence, gen_reached
from pool.descriptor import LeaseDescriptor
from pool.errors import (
    HandoffError,
    LeaseExpired,
    LeaseNotFound,
    LeaseReleased,
    PeerRejected,
    PoolError,
    PoolRestarted,
    StaleLease,
    UntrustedProducer,
)
from pool.featurepool import INLINE, epoch_hex, parse_dtype
from pool.protocol import (
    PROTOCOL_VERSION,
    parse_host_port,
    peer_credentials,
    recv_msg,
    send_msg,
)

if TYPE_CHECKING:
    from pool.backends.peer import CrossGpu, GpuLink

LeaseRef = str | LeaseDescriptor | Mapping[str, Any]
# How long ``open`` polls a ready word before it sleeps between polls. A lease is usually
# published within microseconds of its descriptor reaching us (the producer's copy into the
# pool takes a few on the device), and one 100 us sleep costs 100-160 us with the timer's
# slack: more than the whole hand-off took before ``open`` waited on the host.
SPIN_S = 200e-6

_ERRORS: dict[str, type[PoolError]] = {
    "lease_not_found": LeaseNotFound,
    "lease_expired": LeaseExpired,
    "lease_released": LeaseReleased,
    "stale_lease": StaleLease,
    "peer_rejected": PeerRejected,
}


class SlabMapping(Protocol):
    def tensor(self, offset: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor: ...

    def close(self) -> None: ...


def _host_slab(fd: int, size: int) -> HostSlab:
    """Map a received host_shm slab read-only; takes ``fd`` (closed here, mapped or not). The
    tensors it gives keep the mapping alive until the last of them is gone."""
    try:
        return HostSlab(fd, size, writable=False)
    finally:
        os.close(fd)


class FeatureClient:
    def __init__(
        self,
        socket_path: str | os.PathLike[str],
        *,
        token: str | None = None,
        device: torch.device | str | None = None,
        timeout_s: float = 10.0,
        cross_gpu: CrossGpu = "auto",
        server_uids: Iterable[int] | None = None,
    ) -> None:
        self.address = str(socket_path)  # a Unix socket path, or tcp://HOST:PORT
        self.remote = self.address.startswith("tcp://")  # a consumer on another node
        if self.remote and not token:
            raise ValueError("a tcp:// hand-off needs the producer's token (token=...)")
        if self.remote and server_uids is not None:
            raise ValueError("server_uids checks a Unix socket's peer; a tcp:// hand-off has none")
        self.token = token
        # uids the producer may run as: checked before every hello (None: any)
        self.server_uids = None if server_uids is None else frozenset(server_uids)
        self.device = torch.device(device) if device is not None else None
        self.cross_gpu: CrossGpu = cross_gpu  # another GPU than the producer's: auto/map/copy
        self.timeout_s = timeout_s
        # open() calls answered with a copy instead of a view, by reason (for the life of this
        # client, across reattach): "no_peer_access", "copy_requested".
        self.fallbacks: dict[str, int] = {}
        self._lock = threading.Lock()
        self._count_lock = threading.Lock()
        self._sock: socket.socket | None = None
        self._ctrl: ControlBlock | None = None
        self._acks: AckBlock | None = None  # this consumer's own opened / ack words
        self._slabs: dict[tuple[str, int], SlabMapping] = {}
        self._transports: dict[str, str] = {}
        self._cuda: Any = None  # pool.backends.cuda_vmm.CudaConsumer when a GPU tier exists
        # Leases this client marked opened, by id: release(id) acks them even once they ended
        # (a lookup of an ended lease fails, and the mark would hold the memory until hang-up).
        self._opened: dict[str, LeaseDescriptor] = {}
        self._closed_why = "client is closed; connect again"
        self.epoch = ""
        self.welcome: dict[str, Any] = {}

    # ---- attach ----------------------------------------------------------------------------

    @classmethod
    def connect(
        cls,
        socket_path: str | os.PathLike[str],
        *,
        token: str | None = None,
        device: torch.device | str | None = None,
        timeout_s: float = 10.0,
        cross_gpu: CrossGpu = "auto",
        server_uids: Iterable[int] | None = None,
    ) -> FeatureClient:
        """Attach to a producer: receive the control block and slab FDs once and map them.
        ``device``: the GPU to read on (default: the producer's); ``cross_gpu`` when that is
        another GPU: ``auto`` (in place with peer access, else copies), ``map`` (in place or
        an error), ``copy`` (always copies). ``server_uids``: the uids the producer may run as
        (the service's, 10001 in the image). The socket's listener is checked by the kernel's
        account of it (SO_PEERCRED) before the hello, and so the token, is sent; another uid
        raises UntrustedProducer. Without it, whoever serves the path is believed (a process
        that took the name first, in a directory others can write to)."""
        client = cls(
            socket_path,
            token=token,
            device=device,
            timeout_s=timeout_s,
            cross_gpu=cross_gpu,
            server_uids=server_uids,
        )
        client._attach()
        return client

    @classmethod
    def for_gpu(
        cls,
        socket_dir: str | os.PathLike[str] | None = None,
        *,
        gpu_uuid: str | None = None,
        cuda_index: int | None = None,
        owner_uids: Iterable[int] | None = None,
        token: str | None = None,
        timeout_s: float = 10.0,
    ) -> FeatureClient:
        """Attach to the featpool of a GPU, found in ``socket_dir`` by the discovery rule of
        ``pool.discovery`` (by UUID, or by this process's CUDA index, which is also the device
        the features are mapped on; ``owner_uids``: trust only entries those uids wrote, and
        only a socket served by one of them). Call it again after a ConnectionError to follow a
        rolling update to the new pod."""
        from pool.discovery import find

        entry = find(socket_dir, gpu_uuid=gpu_uuid, cuda_index=cuda_index, owner_uids=owner_uids)
        device = f"cuda:{cuda_index}" if cuda_index is not None else None
        return cls.connect(
            entry.socket, token=token, device=device, timeout_s=timeout_s, server_uids=owner_uids
        )

    def _connect(self) -> socket.socket:
        if not self.remote:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(self.timeout_s)
            try:
                sock.connect(self.address)
                self._check_producer(sock)
            except BaseException:
                sock.close()
                raise
            return sock
        address = parse_host_port(self.address.removeprefix("tcp://"))
        sock = socket.create_connection(address, timeout=self.timeout_s)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return sock

    def _check_producer(self, sock: socket.socket) -> None:
        """Refuse a socket whose listener runs as a uid not in ``server_uids``: the uid is the
        kernel's (SO_PEERCRED), not the peer's word, and nothing has been sent yet."""
        if self.server_uids is None:
            return
        pid, uid, _ = peer_credentials(sock)
        if uid not in self.server_uids:
            raise UntrustedProducer(
                f"{self.address} is served by uid {uid} (pid {pid}), not one of "
                f"{sorted(self.server_uids)} (server_uids): nothing was sent to it"
            )

    def _attach(self) -> None:
        sock = self._connect()
        try:
            hello: dict[str, Any] = {"op": "hello", "version": PROTOCOL_VERSION, "pid": os.getpid()}
            if self.token is not None:
                hello["token"] = self.token
            try:
                send_msg(sock, hello)
            except (BrokenPipeError, ConnectionResetError):
                pass  # a server that refuses the peer may close first: its answer is still queued
            msg, fds = recv_msg(sock, want_fds=not self.remote)
        except BaseException:
            sock.close()
            raise
        try:
            _raise_if_error(msg)
            if self.remote:
                if msg["op"] != "welcome" or not msg.get("remote"):
                    raise HandoffError(f"unexpected answer to a remote hello: {msg['op']}")
                self._map_remote(msg)
            else:
                if msg["op"] != "welcome" or len(fds) != 2 + len(msg["slabs"]):
                    raise HandoffError(
                        f"unexpected answer to hello: {msg['op']} with {len(fds)} FDs"
                    )
                self._map(msg, fds)
        except BaseException:
            sock.close()
            self._unmap()
            for fd in fds:  # only those no mapper took (each mapper closes the FD it takes)
                os.close(fd)
            raise
        self._sock = sock
        self.epoch = msg["epoch"]
        self.welcome = msg

    def _map(self, msg: dict[str, Any], fds: list[int]) -> None:
        """Map what the welcome carries. Each FD is popped from ``fds`` as it is handed to the
        mapper that takes it, so on failure the caller closes only the rest: each exactly once."""
        self._ctrl = ControlBlock.attach(fds.pop(0))  # read-only
        self._acks = AckBlock.attach(fds.pop(0), self._ctrl.nslots)  # ours, read-write
        if epoch_hex(self._ctrl.epoch) != msg["epoch"]:
            raise HandoffError("control block epoch does not match the welcome message")
        for slab in msg["slabs"]:
            self._transports[slab["tier"]] = slab["transport"]
            key = (slab["tier"], slab["index"])
            if slab["transport"] == "host_shm":
                self._slabs[key] = _host_slab(fds.pop(0), slab["size"])
            elif slab["transport"] == "cuda_vmm":
                consumer = self._cuda_consumer(msg)
                self._slabs[key] = consumer.map_slab(fds.pop(0), slab["size"])
            else:
                raise HandoffError(f"unknown transport {slab['transport']!r}")

    def _map_remote(self, msg: dict[str, Any]) -> None:
        """Map the GPU tier and its device control words through FABRIC handles."""
        from pool.backends.cuda_vmm import CudaConsumer

        self._cuda = CudaConsumer(None, msg.get("cuda", {}), self.device)
        ctl = msg["control"]
        self._cuda.map_remote_control(ctl["fabric_handle"], int(ctl["size"]), int(ctl["nslots"]))
        for slab in msg["slabs"]:
            self._transports[slab["tier"]] = slab["transport"]
            self._slabs[(slab["tier"], slab["index"])] = self._cuda.map_fabric(
                slab["fabric_handle"], int(slab["size"])
            )

    def _cuda_consumer(self, msg: dict[str, Any]) -> Any:
        if self._cuda is None:
            from pool.backends.cuda_vmm import CudaConsumer

            assert self._ctrl is not None
            self._cuda = CudaConsumer(
                self._ctrl,
                msg.get("cuda", {}),
                self.device,
                acks=self._acks,
                cross_gpu=self.cross_gpu,
            )
        return self._cuda

    @property
    def link(self) -> GpuLink | None:
        """How this client reaches the producer's GPU (None without a GPU tier, or on another
        node): its GPU and ours, and the path (same_device, peer, or copy and why)."""
        return self._cuda.link if self._cuda is not None else None

    def reattach(self) -> None:
        """Drop every mapping and attach again (after the producer restarted)."""
        self.close()
        self._attach()

    # ---- leases ----------------------------------------------------------------------------

    def lookup(self, lease_id: str) -> dict[str, Any]:
        """The lease's descriptor, from the producer."""
        return self._lookup(lease_id).wire()

    def _lookup(self, lease_id: str) -> LeaseDescriptor:
        reply = self._request({"op": "lookup", "lease_id": lease_id})
        return LeaseDescriptor.parse(reply["lease"])

    def open(
        self, lease: LeaseRef, *, timeout_s: float | None = None, host_wait: bool = True
    ) -> torch.Tensor:
        """A zero-copy, read-only tensor over the lease's features. It keeps its mapping alive
        (also after ``close`` or ``reattach``) until the last view of it is gone.

        Marks the lease opened in this consumer's ack words first: from then on the producer
        does not reuse its memory until ``release`` (or this client's disconnect), even past
        the deadline or a DELETE (docs/protocol.md 4). One mark per lease and client: a
        second ``open`` of the same lease in this client shares it, and the first ``release``
        lets the memory go for both (open once per client and share the view). Then waits on
        the host, up to ``timeout_s`` (default: the client's ``timeout_s``), until the lease
        is published, raising TimeoutError if it is not (a producer that died before
        publishing). On the GPU tier it then also enqueues the stream wait on the ready word,
        which orders your later kernels on the current stream after the producer's copy.

        ``host_wait=False`` (GPU tier): skip the host wait and return at once, with only the
        stream wait enqueued; nothing then bounds that wait if the producer dies before its
        copy (the stream waits until this process exits). A consumer on another node always
        works this way: it has no host-visible ready word.

        On another GPU than the producer's without peer access (``self.link.path == "copy"``)
        this returns a copy in this client's GPU, enqueued after the stream wait, and counts it
        in ``self.fallbacks``; ``release`` may follow at once (the ack is ordered after it).
        """
        desc = self._descriptor(lease)
        if desc.tier == INLINE:
            raise PoolError(
                f"lease {desc.lease_id} is inline (every pool tier was full): fetch it with "
                f"GET /v1/leases/{desc.lease_id}/tensor and release it with release()"
            )
        ctrl = self._check_live(desc)
        slot, gen, offset = desc.slot, desc.generation, desc.offset
        mapping = self._slabs.get((desc.tier, desc.slab)) if desc.slab is not None else None
        if mapping is None or offset is None:
            raise PoolError(
                f"lease {desc.lease_id} is on the {desc.tier} tier, which this client "
                f"has not mapped (a consumer on another node maps only the GPU tier): fetch it "
                f"with GET /v1/leases/{desc.lease_id}/tensor"
            )
        gpu = self._transports[desc.tier] == "cuda_vmm"

        def view() -> torch.Tensor:  # once marked opened (or on another node: no marks there)
            if ctrl is not None and (host_wait or not gpu):
                limit = self.timeout_s if timeout_s is None else timeout_s
                started = time.monotonic()
                while not gen_reached(ctrl.ready(slot), gen):
                    if ctrl.gen(slot) != gen:
                        raise StaleLease(f"lease {desc.lease_id} ended before it was ready")
                    waited = time.monotonic() - started
                    if waited > limit:
                        raise TimeoutError(
                            f"lease {desc.lease_id} not published after {limit}s: the "
                            f"producer may have died before its copy (lookup or reattach to "
                            f"find out)"
                        )
                    if waited > SPIN_S:
                        time.sleep(0.0001)
            if gpu:
                self._cuda.wait_ready(slot, gen)
            shape = tuple(desc.shape)
            out: torch.Tensor = mapping.tensor(offset, parse_dtype(desc.dtype), shape)
            reason = self._cuda.copy_reason if gpu else ""
            if reason:
                out = self._cuda.copy_here(out)
                with self._count_lock:
                    self.fallbacks[reason] = self.fallbacks.get(reason, 0) + 1
            return out

        if ctrl is None:
            return view()
        self._mark_opened(desc, ctrl, slot, gen)
        try:
            out = view()
        except BaseException:  # no view for the caller to release: our mark must not hold it
            self._withdraw(slot, gen)
            raise
        self._opened[desc.lease_id] = desc
        return out

    def _mark_opened(self, desc: LeaseDescriptor, ctrl: ControlBlock, slot: int, gen: int) -> None:
        """Write our ``opened`` word, then (after a full fence) check the lease is still in
        its slot: the producer clears ``gen`` before it reads ``opened`` marks, so either it
        sees ours and keeps the memory, or we see its clear and do not read."""
        assert self._acks is not None
        self._acks.set_opened(slot, gen)
        full_fence()
        if ctrl.gen(slot) != gen:
            self._withdraw(slot, gen)
            raise StaleLease(f"lease {desc.lease_id} is gone (released, expired, or reused)")

    def _withdraw(self, slot: int, gen: int) -> None:
        """We will not read this lease after all: ack it in our words (host store), so our
        ``opened`` mark does not hold its memory."""
        assert self._acks is not None
        self._acks.set_ack(slot, gen)

    def is_current(self, lease: LeaseRef) -> bool:
        """True while the lease still owns its slot. Check it after reading if the deadline may
        have passed while you read: False means the lease ended (its bytes stay in place while
        you hold it open, on this node). Raises PoolRestarted for a lease of another epoch."""
        desc = self._descriptor(lease)
        self._check_epoch(desc)
        if self._ctrl is None:  # another node: only the producer knows
            try:
                return self._lookup(desc.lease_id).generation == desc.generation
            except (LeaseNotFound, LeaseExpired, LeaseReleased):
                return False
        return self._ctrl.gen(desc.slot) == desc.generation

    def release(self, lease: LeaseRef) -> None:
        """Tell the producer you are done. Writes this consumer's ack word (stream-ordered on
        the GPU tier, after your reads); inline leases are released over the socket. The ack is
        written even if the lease already ended (it frees memory quarantined for you), then
        StaleLease says it had. Raises PoolRestarted for a lease of another epoch."""
        mine = self._opened.get(lease) if isinstance(lease, str) else None
        desc = mine or self._descriptor(lease)
        self._check_epoch(desc)
        self._opened.pop(desc.lease_id, None)
        if desc.tier == INLINE:
            self._request({"op": "release", "lease_id": desc.lease_id})
            return
        slot, gen = desc.slot, desc.generation
        # Read before the ack: once it lands, the producer may free the slot at once, and a
        # read after it would report this very release as the lease having ended before.
        ended = self._ctrl is not None and self._ctrl.gen(slot) != gen
        if self._transports.get(desc.tier) == "cuda_vmm":
            self._cuda.ack(slot, gen)
        elif self._acks is not None:
            self._acks.set_ack(slot, gen)
        else:  # a tier this client has not mapped: release over the connection
            self._request({"op": "release", "lease_id": desc.lease_id})
            return
        if ended:
            raise StaleLease(f"lease {desc.lease_id} had already ended (acked anyway)")

    def renew(self, lease: LeaseRef, ttl_s: float | None = None) -> dict[str, Any]:
        """Extend the deadline to ``ttl_s`` from now (the producer's default TTL without it,
        capped by its maximum). Raises PoolRestarted for a lease of another epoch."""
        desc = self._descriptor(lease)
        self._check_epoch(desc)
        reply = self._request({"op": "renew", "lease_id": desc.lease_id, "ttl_s": ttl_s})
        return dict(reply["lease"])

    # ---- helpers ---------------------------------------------------------------------------

    def _descriptor(self, lease: LeaseRef) -> LeaseDescriptor:
        """The descriptor, checked (a bad one raises pydantic's ValidationError, a
        ValueError); one given as a ``LeaseDescriptor`` was checked when it was made."""
        return self._lookup(lease) if isinstance(lease, str) else LeaseDescriptor.parse(lease)

    def _check_live(self, desc: LeaseDescriptor) -> ControlBlock | None:
        """The host control block (None on another node), once the lease is known to be of
        this pool instance and, where the block is readable, still in its slot."""
        self._check_epoch(desc)
        if self._ctrl is not None and self._ctrl.gen(desc.slot) != desc.generation:
            raise StaleLease(
                f"lease {desc.lease_id} is gone (released, expired, or its slot reused)"
            )
        return self._ctrl

    def _check_epoch(self, desc: LeaseDescriptor) -> None:
        if self._sock is None:
            raise HandoffError(self._closed_why)
        if desc.epoch != self.epoch:
            raise PoolRestarted(
                f"lease {desc.lease_id} is from pool epoch {desc.epoch} but this client is "
                f"attached to epoch {self.epoch}: the producer restarted (call reattach() and "
                f"get new leases), or the lease is another featpool's (map it through the "
                f"socket of the server that made it)"
            )

    def _request(self, msg: dict[str, Any]) -> dict[str, Any]:
        with self._lock:
            if self._sock is None:
                raise HandoffError(self._closed_why)
            try:
                send_msg(self._sock, msg)
                reply, _ = recv_msg(self._sock)
            except (ConnectionError, BrokenPipeError) as e:
                raise PoolRestarted(
                    f"the producer closed the hand-off connection ({e}); it may have restarted: "
                    f"call reattach()"
                ) from e
            except BaseException:
                # A timeout (or a broken frame) leaves this request's answer, or part of it,
                # on the connection: the next request would read it as its own (another
                # lease's descriptor). The connection is dropped; reattach() makes a new one.
                self._sock.close()
                self._sock = None
                self._closed_why = (
                    f"the hand-off connection was dropped after a failed {msg.get('op')!r} "
                    f"request (a timeout or a broken frame): call reattach(); the producer "
                    f"no longer keeps the leases this client held open"
                )
                raise
        _raise_if_error(reply)
        return reply

    def _unmap(self) -> None:
        for m in self._slabs.values():
            m.close()
        self._slabs.clear()
        self._transports.clear()
        if self._cuda is not None:
            self._cuda.close()
            self._cuda = None
        if self._acks is not None:
            self._acks.close()
            self._acks = None
        if self._ctrl is not None:
            self._ctrl.close()
            self._ctrl = None

    def close(self) -> None:
        """Unmap (on the GPU after this process's queued reads and acks finished), then hang
        up: the producer frees what only this consumer held open. Tensors from ``open`` stay
        mapped (reading them does not fault) until they are gone, but their memory is the
        pool's again: a later put may overwrite it. Release or drop them first."""
        self._opened.clear()  # the marks go with the connection
        self._closed_why = "client is closed; connect again"
        try:
            self._unmap()
        finally:
            with self._lock:
                if self._sock is not None:
                    self._sock.close()
                    self._sock = None

    def __enter__(self) -> FeatureClient:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def _raise_if_error(msg: dict[str, Any]) -> None:
    if msg.get("op") == "error":
        cls = _ERRORS.get(str(msg.get("type")), HandoffError)
        raise cls(str(msg.get("message", "error")))
