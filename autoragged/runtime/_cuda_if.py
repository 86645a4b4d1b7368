"""A SWITCH node in a CUDA graph captured by PyTorch, through the CUDA driver API.

A conditional graph node of type SWITCH (CUDA 12.8+) runs one of its body graphs, the one a handle names; a
kernel earlier in the same graph sets the handle on the device. So a replay can take a branch that only the
device knows, without a host sync. PyTorch 2.11 exposes none of it to Python (`CUDAGraph.begin_capture_to_if_node`
came later, and IF nodes only), so `add_branches` does it, inside an active capture on the current stream:

1. `cuGraphConditionalHandleCreate` on the graph being captured (`cuStreamGetCaptureInfo`);
2. a one-thread kernel, compiled once per device with NVRTC and captured on the stream, that picks the branch
   from a count on the device and calls `cudaGraphSetConditional`;
3. the SWITCH node, added after the stream's current dependencies (`cuGraphAddNode`), each of its bodies holding a
   copy of a graph captured beforehand (`cuGraphAddChildGraphNode`); the stream's later work depends on the node.

The bodies are captured beforehand, each as a PyTorch graph of its own (`CUDAGraph(keep_graph=True)`) on the same
memory pool, rather than into the node's body graphs from other streams: PyTorch's allocator routes a capture's
allocations to the graph's pool by capture id, and a body's capture would have another one.

`why_not(device)` says why this cannot run there (driver entry points, a CUDA 12.8+ driver, NVRTC, PyTorch's
`raw_cuda_graph`), None where it can; where not, the callers keep their graphs without conditional nodes.
"""

from __future__ import annotations

import ctypes
import glob
import os
import sys

import torch

__all__ = ["add_branches", "why_not", "pick_branch_ref"]

_MAX_BRANCHES = 16
_SOURCE = r"""
typedef __device_builtin__ unsigned long long cudaGraphConditionalHandle;
extern "C" __device__ __cudart_builtin__ void cudaGraphSetConditional(cudaGraphConditionalHandle handle,
                                                                      unsigned int value);
// Branch i (i < n_bounds) takes a count t with bounds[2 i] < t <= bounds[2 i + 1] (the first such); the last
// branch, n_bounds, takes a count no bound holds. Sets the SWITCH node's handle to it and writes it to *taken.
extern "C" __global__ void autoragged_pick_branch(const int* count, const int* bounds, int n_bounds, int* taken,
                                                  cudaGraphConditionalHandle handle) {
    const int t = count[0];
    int pick = n_bounds;
    for (int i = 0; i < n_bounds; ++i) {
        if (bounds[2 * i] < t && t <= bounds[2 * i + 1]) { pick = i; break; }
    }
    cudaGraphSetConditional(handle, (unsigned int)pick);
    *taken = pick;
}
"""

_CU_GRAPH_NODE_TYPE_CONDITIONAL = 13
_CU_GRAPH_COND_TYPE_SWITCH = 2
_CU_GRAPH_COND_ASSIGN_DEFAULT = 1
_CU_STREAM_SET_CAPTURE_DEPENDENCIES = 1
_CU_STREAM_CAPTURE_STATUS_ACTIVE = 1


class _ConditionalParams(ctypes.Structure):
    _fields_ = [
        ("handle", ctypes.c_ulonglong),
        ("type", ctypes.c_int),
        ("size", ctypes.c_uint),
        ("phGraph_out", ctypes.POINTER(ctypes.c_void_p)),
        ("ctx", ctypes.c_void_p),
    ]


class _NodeParams(ctypes.Structure):
    """CUgraphNodeParams: the type, 12 reserved bytes, a union of 29 long longs (here the conditional's), and
    one more reserved long long."""

    _fields_ = [
        ("type", ctypes.c_int),
        ("reserved0", ctypes.c_int * 3),
        ("conditional", _ConditionalParams),
        ("pad", ctypes.c_longlong * (29 - ctypes.sizeof(_ConditionalParams) // 8)),
        ("reserved2", ctypes.c_longlong),
    ]


_STATE: dict = {}  # "driver": the CDLL, "kernel": {device index: CUfunction}, "error": why not supported


def _check(result: int, what: str) -> None:
    if result != 0:
        raise RuntimeError(f"{what} failed: CUDA driver error {result}")


def _driver():
    lib = _STATE.get("driver")
    if lib is None:
        lib = ctypes.CDLL("libcuda.so.1")
        vp, sz, u, p = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint, ctypes.POINTER
        sigs = {
            "cuDriverGetVersion": [p(ctypes.c_int)],
            "cuCtxGetCurrent": [p(vp)],
            "cuModuleLoadData": [p(vp), ctypes.c_char_p],
            "cuModuleGetFunction": [p(vp), vp, ctypes.c_char_p],
            "cuLaunchKernel": [vp, u, u, u, u, u, u, u, vp, p(vp), p(vp)],
            "cuStreamGetCaptureInfo_v3": [vp, p(ctypes.c_int), p(ctypes.c_ulonglong), p(vp), p(p(vp)), p(vp), p(sz)],
            "cuGraphConditionalHandleCreate": [p(ctypes.c_ulonglong), vp, vp, u, u],
            "cuGraphAddNode_v2": [p(vp), vp, p(vp), vp, sz, p(_NodeParams)],
            "cuGraphAddChildGraphNode": [p(vp), vp, p(vp), sz, vp],
            "cuStreamUpdateCaptureDependencies_v2": [vp, p(vp), vp, sz, u],
        }
        for name, args in sigs.items():
            fn = getattr(lib, name)  # AttributeError: a driver without it
            fn.argtypes, fn.restype = args, ctypes.c_int
        _STATE["driver"] = lib
    return lib


def _nvrtc():
    """NVRTC as PyTorch's CUDA wheels ship it (nvidia/*/lib), or the system's."""
    candidates = []
    for root in sys.path:
        candidates += sorted(glob.glob(os.path.join(root, "nvidia", "*", "lib", "libnvrtc.so*")))
        candidates += sorted(glob.glob(os.path.join(root, "nvidia", "*", "*", "lib", "libnvrtc.so*")))
    candidates += ["libnvrtc.so"]
    for path in candidates:
        if "builtins" in path:
            continue
        try:
            return ctypes.CDLL(path)
        except OSError:
            continue
    raise OSError("no libnvrtc found")


def _compile(arch: str) -> bytes:
    """PTX of _SOURCE for `arch` (e.g. "compute_90")."""
    nv = _nvrtc()
    prog = ctypes.c_void_p()
    r = nv.nvrtcCreateProgram(ctypes.byref(prog), _SOURCE.encode(), b"autoragged_if.cu", 0, None, None)
    if r != 0:
        raise RuntimeError(f"nvrtcCreateProgram failed: {r}")
    try:
        opts = [f"--gpu-architecture={arch}".encode()]
        arr = (ctypes.c_char_p * len(opts))(*opts)
        r = nv.nvrtcCompileProgram(prog, len(opts), arr)
        if r != 0:
            size = ctypes.c_size_t()
            nv.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
            log = ctypes.create_string_buffer(size.value)
            nv.nvrtcGetProgramLog(prog, log)
            raise RuntimeError(f"NVRTC could not compile the IF-node kernel: {log.value.decode(errors='replace')}")
        size = ctypes.c_size_t()
        _check(nv.nvrtcGetPTXSize(prog, ctypes.byref(size)), "nvrtcGetPTXSize")
        ptx = ctypes.create_string_buffer(size.value)
        _check(nv.nvrtcGetPTX(prog, ptx), "nvrtcGetPTX")
        return ptx.value
    finally:
        nv.nvrtcDestroyProgram(ctypes.byref(prog))


def _kernel(index: int) -> ctypes.c_void_p:
    kernels = _STATE.setdefault("kernel", {})
    fn = kernels.get(index)
    if fn is None:
        major, minor = torch.cuda.get_device_capability(index)
        ptx = _compile(f"compute_{major}{minor}")
        drv = _driver()
        with torch.cuda.device(index):
            # makes the device's primary context current on this thread (once a device, at the first capture with
            # branches: off the hot path)
            torch.cuda.synchronize(index)
            module, fn = ctypes.c_void_p(), ctypes.c_void_p()
            _check(drv.cuModuleLoadData(ctypes.byref(module), ptx), "cuModuleLoadData")
            _check(drv.cuModuleGetFunction(ctypes.byref(fn), module, b"autoragged_pick_branch"), "cuModuleGetFunction")
        kernels[index] = fn
    return fn


def why_not(device) -> str | None:
    """None where `add_if` works on `device` (a CUDA device or index), else why not (checked once a device)."""
    index = torch.device(device).index if not isinstance(device, int) else device
    index = torch.cuda.current_device() if index is None else index
    errors = _STATE.setdefault("errors", {})
    if index not in errors:
        try:
            if not hasattr(torch.cuda.CUDAGraph, "raw_cuda_graph"):
                raise RuntimeError("this PyTorch's CUDAGraph cannot keep its graph (keep_graph, raw_cuda_graph)")
            version = ctypes.c_int()
            _check(_driver().cuDriverGetVersion(ctypes.byref(version)), "cuDriverGetVersion")
            if version.value < 12080:
                raise RuntimeError(f"the CUDA driver is {version.value}, SWITCH graph nodes need 12080")
            _kernel(index)
            errors[index] = None
        except (OSError, AttributeError, RuntimeError) as e:
            errors[index] = f"{type(e).__name__}: {e}"
    return errors[index]


def pick_branch_ref(count: int, bounds) -> int:
    """The branch the device picks for `count` (the kernel's reference): the first i with
    bounds[i][0] < count <= bounds[i][1], else len(bounds) (the last branch)."""
    return next((i for i, (low, high) in enumerate(bounds) if low < count <= high), len(bounds))


def add_branches(count: torch.Tensor, bounds: torch.Tensor, taken: torch.Tensor, bodies: list[int]) -> None:
    """Inside an active capture on the current stream: a SWITCH node (CUDA 12.8+) whose branches are copies of
    `bodies` (raw cudaGraph_t, as `CUDAGraph.raw_cuda_graph()` gives them), of which a replay runs exactly one:
    body i (i < n, n = bounds' rows) where bounds[i, 0] < count[0] <= bounds[i, 1] (the first such), else the
    last body. `count` and `bounds` are int32 on the device ((n, 2) for bounds); the branch taken is written to
    `taken` (one int32). One kernel before the node picks the branch; the stream's later work follows the node.
    One node for all the branches: as separate IF nodes, each cost about 5-10 us of a replay (H200, 2026-11-26)."""
    n = bounds.shape[0]
    if len(bodies) != n + 1 or len(bodies) > _MAX_BRANCHES:
        raise ValueError(f"{len(bodies)} bodies for {n} bounds: need bounds + 1, at most {_MAX_BRANCHES}")
    for name, t in (("count", count), ("bounds", bounds), ("taken", taken)):
        if t.dtype != torch.int32 or not t.is_cuda or not t.is_contiguous():
            raise ValueError(f"{name} must be a contiguous int32 tensor on a CUDA device, got {t.dtype} on {t.device}")
    drv = _driver()
    index = count.device.index if count.device.index is not None else torch.cuda.current_device()
    stream = ctypes.c_void_p(torch.cuda.current_stream(count.device).cuda_stream)

    def capture_info():
        status, graph = ctypes.c_int(), ctypes.c_void_p()
        deps, edges, k = ctypes.POINTER(ctypes.c_void_p)(), ctypes.c_void_p(), ctypes.c_size_t()
        _check(drv.cuStreamGetCaptureInfo_v3(stream, ctypes.byref(status), None, ctypes.byref(graph),
                                             ctypes.byref(deps), ctypes.byref(edges), ctypes.byref(k)),
               "cuStreamGetCaptureInfo")  # fmt: skip
        if status.value != _CU_STREAM_CAPTURE_STATUS_ACTIVE:
            raise RuntimeError("add_branches needs an active capture on the current stream")
        return graph, deps, edges, k.value

    graph = capture_info()[0]
    ctx = ctypes.c_void_p()
    _check(drv.cuCtxGetCurrent(ctypes.byref(ctx)), "cuCtxGetCurrent")
    handle = ctypes.c_ulonglong(0)
    _check(drv.cuGraphConditionalHandleCreate(ctypes.byref(handle), graph, ctx, n, _CU_GRAPH_COND_ASSIGN_DEFAULT),
           "cuGraphConditionalHandleCreate")  # fmt: skip
    # the kernel that picks the branch and sets the handle, captured on the stream
    values = [ctypes.c_void_p(count.data_ptr()), ctypes.c_void_p(bounds.data_ptr()), ctypes.c_int(n),
              ctypes.c_void_p(taken.data_ptr()), handle]  # fmt: skip
    params = (ctypes.c_void_p * len(values))(*(ctypes.cast(ctypes.byref(v), ctypes.c_void_p) for v in values))
    _check(drv.cuLaunchKernel(_kernel(index), 1, 1, 1, 1, 1, 1, 0, stream, params, None), "cuLaunchKernel")
    graph, deps, edges, k = capture_info()
    node_params = _NodeParams()
    node_params.type = _CU_GRAPH_NODE_TYPE_CONDITIONAL
    node_params.conditional.handle = handle.value
    node_params.conditional.type = _CU_GRAPH_COND_TYPE_SWITCH
    node_params.conditional.size = n + 1
    node_params.conditional.ctx = ctx
    node = ctypes.c_void_p()
    _check(drv.cuGraphAddNode_v2(ctypes.byref(node), graph, deps, edges, k, ctypes.byref(node_params)),
           "cuGraphAddNode (SWITCH)")  # fmt: skip
    for i, body in enumerate(bodies):
        child, inside = ctypes.c_void_p(), ctypes.c_void_p(node_params.conditional.phGraph_out[i])
        _check(drv.cuGraphAddChildGraphNode(ctypes.byref(child), inside, None, 0, ctypes.c_void_p(body)),
               "cuGraphAddChildGraphNode")  # fmt: skip
    _check(drv.cuStreamUpdateCaptureDependencies_v2(stream, ctypes.byref(node), None, 1,
                                                    _CU_STREAM_SET_CAPTURE_DEPENDENCIES),
           "cuStreamUpdateCaptureDependencies")  # fmt: skip
