/* Work split among threads for the C kernels of aiayn/kernels/loader.py: the caller fills one task per
 * thread, and run_split runs work on each, the first on the calling thread. A thread that cannot be
 * started has its share done on the calling thread. */
#ifndef AIAYN_SPLIT_H
#define AIAYN_SPLIT_H
#include <pthread.h>
#include <stddef.h>
#include <stdint.h>

#define MAX_THREADS 64

/* nthreads clamped to [1, MAX_THREADS] and to at most one thread per work item. */
static inline int split_threads(int nthreads, int64_t items) {
    if (nthreads < 1) nthreads = 1;
    if (nthreads > MAX_THREADS) nthreads = MAX_THREADS;
    if (nthreads > items) nthreads = (int)(items > 0 ? items : 1);
    return nthreads;
}

/* tasks: n consecutive tasks of size bytes each; work(&task i) for every i. */
static inline void run_split(void *(*work)(void *), void *tasks, size_t size, int n) {
    pthread_t threads[MAX_THREADS];
    int started[MAX_THREADS] = {0};
    char *t = (char *)tasks;
    for (int i = 1; i < n; i++) started[i] = pthread_create(&threads[i], NULL, work, t + i * size) == 0;
    work(t);
    for (int i = 1; i < n; i++) {
        if (started[i]) pthread_join(threads[i], NULL);
        else work(t + i * size); /* no thread to be had: do its share here */
    }
}

#endif
