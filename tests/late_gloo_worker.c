/* LD_PRELOAD shim: gloo's worker threads run late, as on a busy machine, but every time.

   gloo runs each collective on a worker thread ("pt_gloo_runloop"), which completes the
   collective (waking the caller) and only then releases it, freeing its tensors; freeing a
   tensor that has a Python object takes the GIL. When a worker still does that while Python
   shuts down, the process aborts: "terminate called without an active exception". On a busy
   machine that happens about once in 100 launches; with this shim a teardown that leaves gloo's
   threads running fails every time (tests/test_teardown.py, tests/stress_teardown.py --late).

   1. After a worker's condition-variable broadcast (a completion), its next mutex lock (the
      queue lock, taken to release the collective) waits LATE_LOCK_MS (default 5).
   2. A worker taking the GIL back from libtorch waits LATE_GIL_MS (default 300) first.

       cc -shared -fPIC -o late_gloo_worker.so late_gloo_worker.c -ldl
       LD_PRELOAD=$PWD/late_gloo_worker.so torchrun --standalone --nproc_per_node=2 train.py
*/
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static __thread int completed; /* this worker just woke a caller */

static int is_gloo_worker(void) {
    char name[16] = {0};
    pthread_getname_np(pthread_self(), name, sizeof name);
    return strcmp(name, "pt_gloo_runloop") == 0;
}

static void wait_ms(const char *variable, int fallback) {
    const char *value = getenv(variable);
    usleep(1000 * (value ? atoi(value) : fallback));
}

int pthread_cond_broadcast(pthread_cond_t *cond) {
    static int (*real)(pthread_cond_t *);
    if (!real) real = (int (*)(pthread_cond_t *))dlvsym(RTLD_NEXT, "pthread_cond_broadcast",
                                                        "GLIBC_2.3.2");
    if (is_gloo_worker()) completed = 1;
    return real(cond);
}

int pthread_mutex_lock(pthread_mutex_t *mutex) {
    static int (*real)(pthread_mutex_t *);
    if (!real) real = (int (*)(pthread_mutex_t *))dlsym(RTLD_NEXT, "pthread_mutex_lock");
    if (completed) {
        completed = 0;
        wait_ms("LATE_LOCK_MS", 5);
    }
    return real(mutex);
}

void PyEval_RestoreThread(void *tstate) {
    static void (*real)(void *);
    if (!real) real = (void (*)(void *))dlsym(RTLD_NEXT, "PyEval_RestoreThread");
    if (is_gloo_worker()) wait_ms("LATE_GIL_MS", 300);
    real(tstate);
}
