"""The barrier between the kernels of a CPU team (runtime/cpu.py TEAM_RUNNER): no thread starts a kernel before every
thread has finished the one before, whether the others wait by spinning (a short wait) or asleep on the futex (a
thread 300 us late, past the 50 us spin). The runner's own C, with kernels that count what they see."""
import ctypes
from runtime.cpu import TEAM_RUNNER, library_path

KERNELS = r"""
#include <unistd.h>
static int g_done, g_early, g_late;
/* kernel i: every thread checks that all of kernel i - 1 is done and none of kernel i + 1 has begun, then counts */
static void g_step(void* const* args) {
  long i = (long)args[0];
  int threads = omp_get_num_threads(), done = __atomic_load_n(&g_done, __ATOMIC_SEQ_CST);
  if (done < i * threads) __atomic_add_fetch(&g_early, 1, __ATOMIC_SEQ_CST);
  if (done >= (i + 1) * threads) __atomic_add_fetch(&g_late, 1, __ATOMIC_SEQ_CST);
  if (omp_get_thread_num() == 0 && i % 3 == 0) usleep(300);   /* the others sleep on the futex */
  __atomic_add_fetch(&g_done, 1, __ATOMIC_SEQ_CST);
}
int g_check(int kernels, int threads, int* early, int* late) {
  uintptr_t fns[256], args[256]; int offsets[256];
  for (int i = 0; i < kernels; i++) { fns[i] = (uintptr_t)g_step; args[i] = (uintptr_t)i; offsets[i] = i; }
  int before = omp_get_max_threads();
  omp_set_num_threads(threads);
  g_done = g_early = g_late = 0;
  g_run_team(kernels, fns, offsets, args);
  omp_set_num_threads(before);
  *early = g_early; *late = g_late;
  return g_done;
}
"""


def test_no_thread_starts_a_kernel_before_the_team_finished_the_one_before():
  lib = ctypes.CDLL(str(library_path(TEAM_RUNNER + KERNELS)))
  early, late = ctypes.c_int(), ctypes.c_int()
  for threads in (2, 4):
    done = lib.g_check(200, threads, ctypes.byref(early), ctypes.byref(late))
    assert done == 200 * threads        # every thread ran every kernel
    assert (early.value, late.value) == (0, 0)
