// cg_toggle: callgrind's instrumentation switches as a shared library, so
// that block_cg.py (ctypes) measures only its iterations, as remat_block_cg
// does with the same client requests. No effect outside valgrind.
#include <valgrind/callgrind.h>

extern "C" {
void cg_start() { CALLGRIND_START_INSTRUMENTATION; }
void cg_stop() { CALLGRIND_STOP_INSTRUMENTATION; }
}
