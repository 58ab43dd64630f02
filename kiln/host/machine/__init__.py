"""This host as it is: memory, CPUs, GPUs and compile target, a CUDA context's memory, the host cache directory.

Purpose: `probe` (what a host says about itself: the node's or its cgroup's
memory and CPUs, GPUs through NVML or a child process, its compile target),
`device_memory` (a CUDA context's size and the allocator's peaks) and `cache`
(the host's cache directory: where it is, whether it takes writes and has room).

Contracts: reads only; the decisions over these readings are kiln.core's.

Pitfalls: no CUDA context in the probing process (a child process or NVML
asks the device).
"""
