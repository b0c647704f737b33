"""The cuda backend's planes: CudaPlane's __cuda_array_interface__ (checked everywhere), and on a
machine with a GPU a session of memra-kvd --backend=cuda whose planes are opened once through
ctypes (cudaIpcOpenMemHandle), written and read back, with the interprocess-event ordering.
Without a device the device tests skip, saying why."""

import numpy as np
import pytest

import memra_kv
from memra_kv import KvError
from memra_kv.planes import PlaneGeometry
from kvtest import dense_plan


def cuda_or_skip():
    try:
        return memra_kv.CudaRuntime()
    except KvError as error:
        pytest.skip("no CUDA device: %s" % error.message)


def test_cuda_array_interface_has_the_plane_row_shape():
    keys = PlaneGeometry(memra_kv.KEYS, 0, 512, 10 * 68 + 8, 10, 68)
    plane = memra_kv.CudaPlane(0x7f0000000000, keys, runtime=None)
    assert plane.__cuda_array_interface__ == {
        "shape": (10, 68), "typestr": "|u1", "data": (0x7f0000000000, False), "version": 3,
        "strides": None, "stream": None}
    latent = PlaneGeometry(memra_kv.LATENT_ROWS, 0, 0, 6 * 32, 6, 32)
    interface = memra_kv.CudaPlane(0x1000, latent, None).__cuda_array_interface__
    assert (interface["shape"], interface["typestr"]) == ((6, 8), "<f4")
    mirror = PlaneGeometry(memra_kv.LEN_MIRROR, 0, 256, 4, 1, 4)
    assert memra_kv.CudaPlane(0x2000, mirror, None).__cuda_array_interface__["shape"] == (1,)


def test_cuda_session_planes_open_once_and_hold_what_is_written(kvd):
    runtime = cuda_or_skip()
    daemon = kvd("--backend=cuda")
    with memra_kv.Client.connect(daemon.socket,
                                 mapper=memra_kv.CudaArenaMapper(runtime.device)) as client:
        client.attach("py-cuda")
        assert client.backend == "cuda"
        event, handle = client.mapper.runtime.interprocess_event()
        plan = client.register_plan(dense_plan(2, 32, 1))
        session = client.create_session(plan, 256)
        session.set_wait_event(handle)
        assert client.mapper.opens == 1
        keys = session.plane(0, memra_kv.KEYS)
        tx = session.begin()
        append = session.prepare_append(tx.generation, 16)
        rows = np.arange(16 * keys.shape[1], dtype=np.uint8).reshape(16, -1)
        host = keys.to_host()
        host[:16] = rows
        keys.from_host(host)
        client.mapper.runtime.record(event)
        session.publish_append(tx.generation)
        assert session.commit(tx.generation, 16) == 16
        assert (session.plane(0, memra_kv.KEYS).to_host()[:16] == rows).all()
        assert session.plane(0, memra_kv.LEN_MIRROR).to_host()[0] == 16
        assert client.mapper.opens == 1, "a plane lookup re-opened the arena"
        assert append.layers[0].write_row == 0
        session.release()


def torch_cuda_or_skip():
    """torch with a CUDA device (the GPU machine's image has it), or a skip saying why."""
    try:
        import torch
    except ImportError as error:
        pytest.skip("no torch: %s" % error)
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device: torch.cuda.is_available() is False")
    return torch


def test_cuda_planes_are_torch_tensors_over_the_arena(kvd):
    """An engine's view: torch tensors over the planes (zero copy through
    __cuda_array_interface__), written on a torch stream, the interprocess event recorded on that
    stream; the daemon's commit and length mirror see the bytes."""
    runtime = cuda_or_skip()
    torch = torch_cuda_or_skip()
    daemon = kvd("--backend=cuda")
    with memra_kv.Client.connect(daemon.socket,
                                 mapper=memra_kv.CudaArenaMapper(runtime.device)) as client:
        client.attach("py-torch")
        event, handle = client.mapper.runtime.interprocess_event()
        session = client.create_session(client.register_plan(dense_plan(2, 32, 1)), 256)
        session.set_wait_event(handle)
        plane = session.plane(1, memra_kv.KEYS)
        keys = torch.as_tensor(plane, device="cuda")
        assert keys.data_ptr() == plane.pointer, "torch copied the plane instead of viewing it"
        assert (keys.dtype, tuple(keys.shape)) == (torch.uint8, tuple(plane.shape))
        tx = session.begin()
        session.prepare_append(tx.generation, 24)
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):
            rows = (torch.arange(24 * keys.shape[1], device="cuda") % 251).to(torch.uint8)
            rows = rows.reshape(24, -1)
            keys[:24].copy_(rows)
            client.mapper.runtime.record(event, stream.cuda_stream)
        torch.cuda.current_stream().wait_stream(stream)  # this process reads keys below
        session.publish_append(tx.generation)
        assert session.commit(tx.generation, 24) == 24
        mirror = torch.as_tensor(session.plane(1, memra_kv.LEN_MIRROR), device="cuda")
        assert mirror.dtype == torch.int32
        assert int(mirror[0].item()) == 24
        assert torch.equal(keys[:24], rows)
        assert (session.plane(1, memra_kv.KEYS).to_host()[:24] == rows.cpu().numpy()).all()
        assert client.mapper.opens == 1
        session.release()
