// Binds the calling thread's OpenMP team to cores, one thread a core (splitserve/engine/openmp.py).
//
// Two workers that share a small CPU, each with a thread per core, can find both threads of one
// team on the same core: Linux places a waking thread and balances load by weight, and a core
// running only low-priority threads looks nearly free. A team thread that reaches a barrier first
// spins for its partner, which cannot run until the spinner's slice ends, so the two take turns of a
// scheduler slice (~3 ms) each until the balancer moves one. Seen with `perf sched timehist` on 2
// cores: a prefill's two threads alternating on core 0 while the decode worker's two alternated on
// core 1, for the whole prefill. Bound, thread i of every team stays on core i: each core holds one
// thread of each worker, and their priorities decide which one runs.
//
// This runs in the libgomp that torch loaded (splitserve/engine/openmp.py checks there is only one),
// so the threads it binds are the ones torch's parallel regions use: libgomp keeps a master thread's
// pool and reuses its threads for every team of that master as long as no team is smaller. A smaller
// team lets the surplus pool threads exit, and the next full team starts new ones from the master,
// inheriting its one core: so only teams of two are bound (a smaller one is no team at all).
#include <torch/library.h>

#include <omp.h>
#include <sched.h>

#include <cstdint>

namespace {

// A team of cores.size() threads: with one_each, thread i is bound to cores[i]; without, every
// thread may run on all of cores (undoing a binding). Returns how many threads were set.
int64_t bind_openmp_team(c10::ArrayRef<int64_t> cores, bool one_each) {
  const int n = static_cast<int>(cores.size());
  if (n == 0) return 0;
  int64_t bound = 0;
#pragma omp parallel num_threads(n) reduction(+ : bound)
  {
    const int i = omp_get_thread_num();
    cpu_set_t set;
    CPU_ZERO(&set);
    if (one_each) {
      CPU_SET(static_cast<int>(cores[i]), &set);
    } else {
      for (int64_t core : cores) CPU_SET(static_cast<int>(core), &set);
    }
    if (sched_setaffinity(0, sizeof(set), &set) == 0) bound += 1;
  }
  return bound;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(splitserve_cpu, m) {
  m.def("bind_openmp_team(int[] cores, bool one_each) -> int", &bind_openmp_team);
}
