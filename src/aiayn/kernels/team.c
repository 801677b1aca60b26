/* Whose threads the kernels' work runs on (split.h): PyTorch's OpenMP team, once the loader has handed
 * over its entry points (GOMP_parallel, the GNU OpenMP ABI that libgomp and LLVM's and Intel's runtimes
 * export; omp_get_thread_num; omp_get_num_threads), else NULLs and threads started by run_split. */
#include <stddef.h>

#include "split.h"

void (*aiayn_team_parallel)(void (*)(void *), void *, unsigned, unsigned) = NULL;
int (*aiayn_team_thread)(void) = NULL;
int (*aiayn_team_size)(void) = NULL;

/* All three, or NULLs (own threads). */
void aiayn_use_team(void *parallel, void *thread, void *size) {
    if (parallel && thread && size) {
        aiayn_team_parallel = (void (*)(void (*)(void *), void *, unsigned, unsigned))parallel;
        aiayn_team_thread = (int (*)(void))thread;
        aiayn_team_size = (int (*)(void))size;
    } else {
        aiayn_team_parallel = NULL;
        aiayn_team_thread = aiayn_team_size = NULL;
    }
}
