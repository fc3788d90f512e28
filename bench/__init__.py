"""Benchmarks: each writes JSON (and PNGs) to bench/results/; see ../shared/BENCHMARKS.md."""
import os

# The benchmarks spawn stacks (subprocess with a preexec_fn forks) from a process that runs
# gRPC; with gRPC's fork support on, the forked child can abort before exec (grpc/grpc#43055).
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")

