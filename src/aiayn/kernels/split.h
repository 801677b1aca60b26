/* Work split among threads for the C kernels of aiayn/kernels/loader.py: the caller fills one task per
 * thread, and run_split runs work on each.
 *
 * Whose threads: PyTorch's own OpenMP team where the loader found it (team.c, aiayn_use_team), else
 * threads started here, the first task on the calling thread. Why the team: after each of its parallel
 * operations PyTorch's OpenMP threads keep spinning for a while, waiting for the next one; threads started
 * here then share the cores with them, so a kernel's second half waits for a time slice (on 2 cores the
 * kernels ran up to twice as long). On PyTorch's team the threads that spin are those that run the work.
 * Either way task i is the same work, so the results do not depend on whose threads ran it. A thread that
 * cannot be started has its share done on the calling thread. */
#ifndef AIAYN_SPLIT_H
#define AIAYN_SPLIT_H
#include <pthread.h>
#include <stddef.h>
#include <stdint.h>

#define MAX_THREADS 64

/* PyTorch's OpenMP runtime (GOMP_parallel, omp_get_thread_num, omp_get_num_threads), or NULLs (team.c). */
extern void (*aiayn_team_parallel)(void (*)(void *), void *, unsigned, unsigned);
extern int (*aiayn_team_thread)(void);
extern int (*aiayn_team_size)(void);

/* nthreads clamped to [1, MAX_THREADS] and to at most one thread per work item. */
static inline int split_threads(int nthreads, int64_t items) {
    if (nthreads < 1) nthreads = 1;
    if (nthreads > MAX_THREADS) nthreads = MAX_THREADS;
    if (nthreads > items) nthreads = (int)(items > 0 ? items : 1);
    return nthreads;
}

typedef struct {
    void *(*work)(void *);
    char *tasks;
    size_t size;
    int n;
} split_job;

/* One member of the team: tasks thread, thread + team size, ... (all n if the team is smaller). */
static void split_member(void *arg) {
    const split_job *job = (const split_job *)arg;
    const int size = aiayn_team_size(), me = aiayn_team_thread();
    for (int i = me; i < job->n; i += size) job->work(job->tasks + i * job->size);
}

/* tasks: n consecutive tasks of size bytes each; work(&task i) for every i. */
static inline void run_split(void *(*work)(void *), void *tasks, size_t size, int n) {
    char *t = (char *)tasks;
    if (n > 1 && aiayn_team_parallel) {
        split_job job = {work, t, size, n};
        aiayn_team_parallel(split_member, &job, (unsigned)n, 0);
        return;
    }
    pthread_t threads[MAX_THREADS];
    int started[MAX_THREADS] = {0};
    for (int i = 1; i < n; i++) started[i] = pthread_create(&threads[i], NULL, work, t + i * size) == 0;
    work(t);
    for (int i = 1; i < n; i++) {
        if (started[i]) pthread_join(threads[i], NULL);
        else work(t + i * size); /* no thread to be had: do its share here */
    }
}

#endif
