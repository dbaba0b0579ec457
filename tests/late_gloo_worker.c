/* LD_PRELOAD shim: gloo's worker threads run late, as on a busy machine, but every time.

   gloo runs each collective on a worker thread ("pt_gloo_runloop"), which completes the
   collective (waking the caller) and only then releases it, freeing its tensors; freeing a
   tensor that has a Python object takes the GIL. When a worker still does that while Python
   shuts down, the process aborts: "terminate called without an active exception". On a busy
   machine that happens about once in 100 launches; with this shim a teardown that leaves gloo's
   threads running fails most launches (tests/test_teardown.py, tests/stress_teardown.py --late;
   a 2-rank FSDP run that keeps a reference to the group: 2 of 3 aborted, as before the GIL wait
   was shortened, which took the run from 31 s to 15 s).

   1. After a worker's condition-variable broadcast (a completion), its next mutex lock (the
      queue lock, taken to release the collective) waits LATE_LOCK_MS (default 5).
   2. A worker taking the GIL back from libtorch after a completion waits LATE_GIL_MS (default
      300) first, or until the next collective is queued: only the last collective before exit
      needs to be late, and waiting after every GIL take made a short FSDP run (about 70 a
      rank, most of them before a completion, with the caller still waiting) last 20 s longer.
      A collective is queued when another thread signals a condition variable that a gloo
      worker waits on (gloo's work queue); where that cannot be seen, every wait is whole.

       cc -shared -fPIC -o late_gloo_worker.so late_gloo_worker.c -ldl
       LD_PRELOAD=$PWD/late_gloo_worker.so torchrun --standalone --nproc_per_node=2 train.py
*/
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static __thread int completed; /* this worker just woke a caller (for the lock) */
static __thread int releasing;  /* ... and has not taken the GIL since (for the GIL) */
static pthread_cond_t *work_queues[16];   /* condition variables gloo's workers wait on */
static unsigned long queued;              /* signals on them: collectives queued so far */

static int is_gloo_worker(void) {
    char name[16] = {0};
    pthread_getname_np(pthread_self(), name, sizeof name);
    return strcmp(name, "pt_gloo_runloop") == 0;
}

static int milliseconds(const char *variable, int fallback) {
    const char *value = getenv(variable);
    return value ? atoi(value) : fallback;
}

static int is_work_queue(pthread_cond_t *cond) {
    for (int i = 0; i < 16; i++)
        if (__atomic_load_n(&work_queues[i], __ATOMIC_ACQUIRE) == cond) return 1;
    return 0;
}

static void note_signal(pthread_cond_t *cond) {
    if (!is_gloo_worker() && is_work_queue(cond)) __atomic_add_fetch(&queued, 1, __ATOMIC_RELEASE);
}

int pthread_cond_wait(pthread_cond_t *cond, pthread_mutex_t *mutex) {
    static int (*real)(pthread_cond_t *, pthread_mutex_t *);
    if (!real) real = (int (*)(pthread_cond_t *, pthread_mutex_t *))dlvsym(
        RTLD_NEXT, "pthread_cond_wait", "GLIBC_2.3.2");
    if (is_gloo_worker() && !is_work_queue(cond)) {  /* remember it: a free slot, first come */
        for (int i = 0; i < 16; i++) {
            pthread_cond_t *empty = NULL;
            if (__atomic_compare_exchange_n(&work_queues[i], &empty, cond, 0, __ATOMIC_ACQ_REL,
                                            __ATOMIC_ACQUIRE)) break;
        }
    }
    return real(cond, mutex);
}

int pthread_cond_signal(pthread_cond_t *cond) {
    static int (*real)(pthread_cond_t *);
    if (!real) real = (int (*)(pthread_cond_t *))dlvsym(RTLD_NEXT, "pthread_cond_signal",
                                                        "GLIBC_2.3.2");
    note_signal(cond);
    return real(cond);
}

int pthread_cond_broadcast(pthread_cond_t *cond) {
    static int (*real)(pthread_cond_t *);
    if (!real) real = (int (*)(pthread_cond_t *))dlvsym(RTLD_NEXT, "pthread_cond_broadcast",
                                                        "GLIBC_2.3.2");
    if (is_gloo_worker()) completed = releasing = 1;
    note_signal(cond);
    return real(cond);
}

int pthread_mutex_lock(pthread_mutex_t *mutex) {
    static int (*real)(pthread_mutex_t *);
    if (!real) real = (int (*)(pthread_mutex_t *))dlsym(RTLD_NEXT, "pthread_mutex_lock");
    if (completed) {
        completed = 0;
        usleep(1000 * milliseconds("LATE_LOCK_MS", 5));
    }
    return real(mutex);
}

void PyEval_RestoreThread(void *tstate) {
    static void (*real)(void *);
    if (!real) real = (void (*)(void *))dlsym(RTLD_NEXT, "PyEval_RestoreThread");
    if (is_gloo_worker() && releasing) {  /* late, unless another collective is queued */
        releasing = 0;
        unsigned long seen = __atomic_load_n(&queued, __ATOMIC_ACQUIRE);
        for (int ms = milliseconds("LATE_GIL_MS", 300); ms > 0; ms--) {
            if (__atomic_load_n(&queued, __ATOMIC_ACQUIRE) != seen) break;
            usleep(1000);
        }
    }
    real(tstate);
}
