/* The recorder's event queue and hot calls in C.
 *
 * `EventQueue` holds a rank's events from the moment they happen until the writer has them
 * written as lines (`write`). Its hot calls (a step's begin and end, a P2P op's post and
 * completion, a memory sample) are what `Recorder`'s Python methods of the same names do
 * (pipetrace/recorder/recorder.py, the plain case: no device timer, no stacks), but keep
 * each event as a few cells in one array (_queue.h) instead of a tuple in a deque: no
 * object is made per event but the id returned, nothing of the interpreter runs, and the
 * event touches a few cache lines at the queue's end. Inside a training step that is what
 * matters: between two events the framework's work evicts the recorder's code and data
 * from the CPU's caches (docs/performance.md, "Recorder").
 *
 * It also keeps what a stall dump lists (the steps begun and not ended, the P2P ops posted
 * and not completed, as their record tuples on demand) and the time of the last progress,
 * which the watchdog reads. Records appended from Python (every other event) are kept as
 * their tuples, in order with the rest. tests/recorder/test_hotpath.py holds the hot calls
 * to the Python methods' events and state.
 *
 * Threads: every call holds the interpreter lock. `write` calls Python (the fallback
 * encoder, a step's text) and may let another thread append meanwhile: it reads entries by
 * index, never by a pointer kept across a call, and only it moves entries.
 */
#include "_queue.h"

#include <structmember.h>
#include <errno.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define MAX_RUN 32 /* ints of a memory sample kept in cells */

/* A step begun and not ended, or a P2P op posted and not completed: its entry's cells. */
#define TRACKED_CELLS 13
typedef struct {
    int64_t id; /* -1: removed */
    Cell cells[TRACKED_CELLS];
} Tracked;

/* Ordered by id (ids are handed out in order); removal marks, and the set is compacted when
 * marks are most of it, so that many ops in flight cost no quadratic moves. */
typedef struct {
    Tracked *items;
    Py_ssize_t len, cap, live;
} TrackSet;

/* The fields every hot call reads come first, in a few cache lines; the encoder's state
 * (`lines`, `out`) and the last sample's ints after them. */
typedef struct {
    PyObject_HEAD
    int open; /* 0: the hot calls refuse (before `open`, after `close`) */
    int flushing, taking;
    int profiling; /* whether a profiler wants ranges this iteration (the recorder sets it) */
    Cell *cells; /* entries [head, tail) wait to be written */
    Py_ssize_t head, tail, cap, count;
    int64_t capacity; /* entries: when reached, on_full() is called */
    int64_t next_id, iteration, progress;
    PyObject *clock; /* () -> monotonic ns; NULL: CLOCK_MONOTONIC read here */
    PyObject *on_full;
    TrackSet open_steps, inflight;
    /* The last memory sample written: ints (kind 1) or a tuple (kind 2); none yet: 0. */
    int last_kind;
    Py_ssize_t last_saved, last_inflight;
    /* The live counts `sample_watched` reads (`watch_memory`): per stage, a dict of bytes
     * held per micro-batch, and two lists of bytes in flight. */
    PyObject *held, *act, *grad;
    int64_t last_ints[MAX_RUN];
    PyObject *last_sample;
    PyObject *step_token, *close_token;
    Lines lines;
    Buffer out;
} Queue;

static PyObject *s_main, *s_sum;

COLD static PyObject *not_recording(void) {
    PyErr_SetString(PyExc_RuntimeError,
                    "the recorder is not recording: begin_run first, and not after close");
    return NULL;
}

COLD static int call_clock(Queue *q, int64_t *t) {
    PyObject *v = PyObject_CallNoArgs(q->clock);
    if (v == NULL) return -1;
    int ok = as_int64(v, t);
    Py_DECREF(v);
    if (!ok) PyErr_SetString(PyExc_TypeError, "the recorder's clock must return an int");
    return ok ? 0 : -1;
}

HOT static int now(Queue *q, int64_t *t) {
    if (q->clock != NULL) return call_clock(q, t);
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    *t = (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
    return 0;
}

HOT static int stamp(Queue *q, int64_t *t) {
    if (now(q, t) < 0) return -1;
    q->progress = *t;
    return 0;
}

/* -- the queue ---------------------------------------------------------------------------- */

/* Append a copy of entry ``e`` (its objects' references taken), then let the writer flush
 * when the bound is reached. */
COLD static int grow_cells(Queue *q, Py_ssize_t n) {
    Py_ssize_t cap = q->cap ? q->cap : 4096;
    while (cap < q->tail + n) cap *= 2;
    Cell *cells = PyMem_Realloc(q->cells, (size_t)cap * sizeof(Cell));
    if (cells == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    q->cells = cells;
    q->cap = cap;
    return 0;
}

COLD static int call_on_full(Queue *q) {
    q->flushing = 1;
    PyObject *done = PyObject_CallNoArgs(q->on_full);
    q->flushing = 0;
    Py_XDECREF(done);
    return done ? 0 : -1;
}

/* Room for an entry of ``n`` cells at the queue's end, for the caller to fill in place and
 * then `commit` (no copy of it made on the stack first: its cells are written once). */
HOT static Cell *reserve(Queue *q, Py_ssize_t n) {
    if (q->tail + n > q->cap && grow_cells(q, n) < 0) return NULL;
    return q->cells + q->tail;
}

/* The entry filled in at the end kept (its objects' references taken), then the writer
 * let flush when the bound is reached. */
HOT static int commit(Queue *q) {
    Cell *e = q->cells + q->tail;
    entry_incref(e);
    q->tail += HEADER_LENGTH(e[0].i);
    q->count++;
    if (q->count < q->capacity || q->on_full == NULL || q->flushing) return 0;
    return call_on_full(q);
}

/* Append a copy of entry ``e``. */
static int push(Queue *q, const Cell *e) {
    Py_ssize_t n = HEADER_LENGTH(e[0].i);
    Cell *to = reserve(q, n);
    if (to == NULL) return -1;
    memcpy(to, e, (size_t)n * sizeof(Cell));
    return commit(q);
}

/* A record kept as its tuple (stolen). */
COLD static int push_tuple(Queue *q, PyObject *record) {
    if (record == NULL) return -1;
    Cell e[2] = {{.i = HEADER(TAG_TUPLE, 2)}, {.o = record}};
    int ok = push(q, e);
    Py_DECREF(record);
    return ok;
}

static void release_all(Queue *q) {
    while (q->head < q->tail) {
        Cell *e = q->cells + q->head;
        q->head += HEADER_LENGTH(e[0].i);
        entry_decref(e);
    }
    q->head = q->tail = q->count = 0;
}

/* All of ``b`` to ``fd``, the interpreter lock released: 0, or -1 with OSError set. */
static int write_all(int fd, const char *data, Py_ssize_t len) {
    int error = 0;
    Py_BEGIN_ALLOW_THREADS
    while (len > 0) {
        ssize_t n = write(fd, data, (size_t)len);
        if (n < 0) {
            if (errno == EINTR) continue;
            error = errno;
            break;
        }
        data += n;
        len -= n;
    }
    Py_END_ALLOW_THREADS
    if (!error) return 0;
    errno = error;
    PyErr_SetFromErrno(PyExc_OSError);
    return -1;
}

/* write(fd, count): the first ``count`` entries written to ``fd`` as their lines. Taken
 * even when writing fails (the error is raised: a full disk loses them, never the run). */
static PyObject *write_lines(Queue *q, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "write(fd, count)");
        return NULL;
    }
    int fd = PyObject_AsFileDescriptor(args[0]);
    Py_ssize_t limit = PyLong_AsSsize_t(args[1]);
    if (fd < 0 || (limit == -1 && PyErr_Occurred())) return NULL;
    if (!q->open) {
        PyErr_SetString(PyExc_RuntimeError, "write: the queue was not opened");
        return NULL;
    }
    if (q->taking) {
        PyErr_SetString(PyExc_RuntimeError, "write: already writing (callers hold a lock)");
        return NULL;
    }
    q->taking = 1;
    q->out.len = 0;
    int failed = 0;
    for (Py_ssize_t done = 0; done < limit && q->head < q->tail && !failed; done++) {
        Cell e[MAX_ENTRY];
        Py_ssize_t n = HEADER_LENGTH(q->cells[q->head].i);
        memcpy(e, q->cells + q->head, (size_t)n * sizeof(Cell));
        failed = lines_put(&q->lines, &q->out, e) < 0;
        q->head += n; /* taken, written or not */
        q->count--;
        entry_decref(e);
    }
    if (!failed) failed = write_all(fd, q->out.data, q->out.len) < 0;
    q->taking = 0;
    Py_ssize_t left = q->tail - q->head;
    if (left == 0) {
        q->head = q->tail = 0;
    } else if (q->head > 4096 && q->head > left) {
        memmove(q->cells, q->cells + q->head, (size_t)left * sizeof(Cell));
        q->head = 0;
        q->tail = left;
    }
    if (q->out.cap > (1 << 22)) { /* keep a usual batch's buffer, not a rare big one */
        PyMem_Free(q->out.data);
        q->out = (Buffer){NULL, 0, 0};
    }
    if (failed) return NULL;
    Py_RETURN_NONE;
}

static Py_ssize_t queue_length(Queue *q) { return q->count; }

/* -- what is open ------------------------------------------------------------------------- */

COLD static int grow_tracked(TrackSet *s) {
    Py_ssize_t cap = s->cap ? 2 * s->cap : 8;
    Tracked *items = PyMem_Realloc(s->items, (size_t)cap * sizeof(Tracked));
    if (items == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    s->items = items;
    s->cap = cap;
    return 0;
}

HOT static int track(TrackSet *s, int64_t id, const Cell *e) {
    if (s->len == s->cap && grow_tracked(s) < 0) return -1;
    Tracked *t = &s->items[s->len++];
    t->id = id;
    for (Py_ssize_t k = 0; k < HEADER_LENGTH(e[0].i); k++) t->cells[k] = e[k];
    entry_incref(e);
    s->live++;
    return 0;
}

/* The removed items dropped (most of the set: many ops were in flight). */
COLD static void compact(TrackSet *s) {
    Py_ssize_t kept = 0;
    for (Py_ssize_t i = 0; i < s->len; i++)
        if (s->items[i].id >= 0) s->items[kept++] = s->items[i];
    s->len = kept;
}

/* The index of ``id`` in ``s`` (ids are increasing, removed ones keep their place), or -1. */
static Py_ssize_t find_tracked(TrackSet *s, int64_t id) {
    Py_ssize_t lo = 0, hi = s->len;
    while (lo < hi) {
        Py_ssize_t mid = (lo + hi) / 2;
        int64_t at = s->items[mid].id < 0 ? -s->items[mid].id - 2 : s->items[mid].id;
        if (at < id) lo = mid + 1;
        else hi = mid;
    }
    return lo < s->len && s->items[lo].id == id ? lo : -1;
}

/* Forget ``id`` if it is there; usually the last one tracked (a step's end, a plain-mode
 * op's completion), found without a search. */
HOT static void untrack(TrackSet *s, int64_t id) {
    Py_ssize_t at = s->len - 1;
    if (at < 0 || s->items[at].id != id) at = find_tracked(s, id);
    if (at < 0) return;
    Tracked *t = &s->items[at];
    t->id = -id - 2; /* removed, still ordered */
    s->live--;
    entry_decref(t->cells);
    if (s->live == 0) s->len = 0;
    else if (s->len - s->live > 32 && s->len - s->live > s->live) compact(s);
}

static void track_clear(TrackSet *s) {
    for (Py_ssize_t i = 0; i < s->len; i++)
        if (s->items[i].id >= 0) entry_decref(s->items[i].cells);
    PyMem_Free(s->items);
    *s = (TrackSet){NULL, 0, 0, 0};
}

/* {id: record tuple} of what is open, in order. */
COLD static PyObject *track_dict(TrackSet *s) {
    PyObject *dict = PyDict_New();
    for (Py_ssize_t i = 0; dict && i < s->len; i++) {
        if (s->items[i].id < 0) continue;
        PyObject *key = PyLong_FromLongLong(s->items[i].id);
        PyObject *record = entry_tuple(s->items[i].cells);
        if (key == NULL || record == NULL || PyDict_SetItem(dict, key, record) < 0)
            Py_CLEAR(dict);
        Py_XDECREF(key);
        Py_XDECREF(record);
    }
    return dict;
}

static PyObject *open_steps(Queue *q, PyObject *unused) { return track_dict(&q->open_steps); }
static PyObject *inflight(Queue *q, PyObject *unused) { return track_dict(&q->inflight); }

/* A record tuple (stolen) kept by the queue and in ``s`` under ``id``: an entry whose values
 * do not fit in cells. */
COLD static int push_tracked(Queue *q, TrackSet *s, int64_t id, PyObject *record) {
    if (record == NULL) return -1;
    Cell kept[2] = {{.i = HEADER(TAG_TUPLE, 2)}, {.o = record}};
    int ok = push(q, kept) == 0 && track(s, id, kept) == 0;
    Py_DECREF(record);
    return ok ? 0 : -1;
}

/* An entry filled in at the queue's end (`reserve`) kept, and in ``s`` under ``id``. */
HOT static int commit_tracked(Queue *q, TrackSet *s, int64_t id) {
    return track(s, id, q->cells + q->tail) == 0 && commit(q) == 0 ? 0 : -1;
}

/* -- the hot calls ------------------------------------------------------------------------ */

/* A step's token when a profiler wants ranges: step_token's, from the step's ``id`` (stolen). */
COLD static PyObject *profiled_token(Queue *q, PyObject *id, PyObject *step) {
    PyObject *token = PyObject_CallFunctionObjArgs(q->step_token, id, step, NULL);
    Py_DECREF(id);
    return token;
}

/* The token of step ``sid``: its id, or a profiler's token from step_token. */
HOT static PyObject *step_token(Queue *q, int64_t sid, PyObject *step) {
    PyObject *id = PyLong_FromLongLong(sid);
    if (id == NULL || !q->profiling) return id;
    return profiled_token(q, id, step);
}

/* begin_at's record for a position that is not an int64: kept as its tuple. */
COLD static PyObject *begin_kept(Queue *q, int64_t t, int64_t sid, PyObject *position,
                                 PyObject *step, PyObject *thread) {
    PyObject *record = Py_BuildValue("(iLLLOOO)", TAG_STEP_BEGIN, (long long)t, (long long)sid,
                                     (long long)q->iteration, position, step, thread);
    if (push_tracked(q, &q->open_steps, sid, record) < 0) return NULL;
    return step_token(q, sid, step);
}

/* A step begun at ``t``: its token. */
HOT static PyObject *begin_at(Queue *q, int64_t t, PyObject *position, PyObject *step,
                              PyObject *thread) {
    int64_t pos, sid = q->next_id++;
    if (!as_int64(position, &pos)) return begin_kept(q, t, sid, position, step, thread);
    Cell *e = reserve(q, 7);
    if (e == NULL) return NULL;
    e[0].i = HEADER(TAG_STEP_BEGIN, 7);
    e[1].i = t;
    e[2].i = sid;
    e[3].i = q->iteration;
    e[4].i = pos;
    e[5].o = step;
    e[6].o = thread;
    if (commit_tracked(q, &q->open_steps, sid) < 0) return NULL;
    return step_token(q, sid, step);
}

HOT static PyObject *begin_step(Queue *q, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs < 2 || nargs > 3) {
        PyErr_SetString(PyExc_TypeError, "begin_step(position, step, thread='main')");
        return NULL;
    }
    if (!q->open) return not_recording();
    int64_t t;
    if (stamp(q, &t) < 0) return NULL;
    return begin_at(q, t, args[0], args[1], nargs == 3 ? args[2] : s_main);
}

/* A record of (tag, t, id): a step's end, a P2P op's completion. */
HOT static int push_id(Queue *q, int tag, int64_t t, int64_t id) {
    Cell *e = reserve(q, 3);
    if (e == NULL) return -1;
    e[0].i = HEADER(tag, 3);
    e[1].i = t;
    e[2].i = id;
    return commit(q);
}

/* The step of ``token`` ended at ``t`` (``nbytes``: a swap launch's, or None): 0 or -1. */
HOT static int end_at(Queue *q, int64_t t, PyObject *token, PyObject *nbytes) {
    int64_t sid;
    PyObject *id = PyTuple_CheckExact(token) ? PyObject_CallOneArg(q->close_token, token)
                                             : Py_NewRef(token);
    if (id == NULL) return -1;
    int fits = as_int64(id, &sid);
    if (fits) untrack(&q->open_steps, sid);
    int ok;
    if (fits && nbytes == Py_None) {
        ok = push_id(q, TAG_STEP_END, t, sid);
    } else if (nbytes == Py_None) {
        ok = push_tuple(q, Py_BuildValue("(iLO)", TAG_STEP_END, (long long)t, id));
    } else { /* a swap launch's bytes */
        ok = push_tuple(q, Py_BuildValue("(iLOO)", TAG_STEP_END, (long long)t, id, nbytes));
    }
    Py_DECREF(id);
    return ok;
}

HOT static PyObject *end_step(Queue *q, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs < 1 || nargs > 2) {
        PyErr_SetString(PyExc_TypeError, "end_step(token, nbytes=None)");
        return NULL;
    }
    if (!q->open) return not_recording();
    int64_t t;
    if (stamp(q, &t) < 0 || end_at(q, t, args[0], nargs == 2 ? args[1] : Py_None) < 0)
        return NULL;
    Py_RETURN_NONE;
}

static const char *const post_names[] = {"op",    "step",   "peer",  "channel", "seq",
                                         "nbytes", "shape", "dtype", "stream"};
#define NPOST 9
static PyObject *post_keys[NPOST]; /* interned: a call site's keywords are the same objects */

/* The index of a keyword in post_names, NPOST if none. */
HOT static int post_index(PyObject *name, Py_ssize_t k) {
    if (k < NPOST && name == post_keys[k]) return (int)k; /* the usual order */
    for (int i = 0; i < NPOST; i++)
        if (name == post_keys[i]) return i;
    for (int i = 0; i < NPOST; i++)
        if (PyUnicode_CompareWithASCIIString(name, post_names[i]) == 0) return i;
    return NPOST;
}

/* p2p_posted's keyword-only arguments in post_names' order; stream may be absent. */
HOT static int post_arguments(PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames,
                              PyObject **values) {
    Py_ssize_t n = kwnames ? PyTuple_GET_SIZE(kwnames) : 0;
    if (nargs) {
        PyErr_SetString(PyExc_TypeError, "p2p_posted takes keyword arguments only");
        return -1;
    }
    for (int i = 0; i < NPOST; i++) values[i] = NULL;
    for (Py_ssize_t k = 0; k < n; k++) {
        PyObject *name = PyTuple_GET_ITEM(kwnames, k);
        int i = post_index(name, k);
        if (i == NPOST || values[i] != NULL) {
            PyErr_Format(PyExc_TypeError, "p2p_posted: unexpected argument %R", name);
            return -1;
        }
        values[i] = args[nargs + k];
    }
    for (int i = 0; i < NPOST - 1; i++) {
        if (values[i] == NULL) {
            PyErr_Format(PyExc_TypeError, "p2p_posted: missing argument '%s'", post_names[i]);
            return -1;
        }
    }
    return 0;
}

HOT static PyObject *p2p_posted(Queue *q, PyObject *const *args, Py_ssize_t nargs,
                                PyObject *kwnames) {
    PyObject *v[NPOST];
    if (post_arguments(args, nargs, kwnames, v) < 0) return NULL;
    if (!q->open) return not_recording();
    int64_t t, peer, seq, nbytes;
    if (stamp(q, &t) < 0) return NULL;
    int64_t pid = q->next_id++;
    if (!as_int64(v[2], &peer) || !as_int64(v[4], &seq) || !as_int64(v[5], &nbytes)) {
        PyObject *record = Py_BuildValue("(iLLLOOOOOOOOO)", TAG_P2P_POST, (long long)t,
                                         (long long)pid, (long long)q->iteration, v[0], v[1],
                                         v[2], v[3], v[4], v[5], v[6], v[7], Py_None);
        if (push_tracked(q, &q->inflight, pid, record) < 0) return NULL;
        return PyLong_FromLongLong(pid);
    }
    /* (tag, t, id, it, op, step, peer, channel, seq, bytes, shape, dtype, stack) */
    Cell *e = reserve(q, 13);
    if (e == NULL) return NULL;
    e[0].i = HEADER(TAG_P2P_POST, 13);
    e[1].i = t;
    e[2].i = pid;
    e[3].i = q->iteration;
    e[4].o = v[0];
    e[5].o = v[1];
    e[6].i = peer;
    e[7].o = v[3];
    e[8].i = seq;
    e[9].i = nbytes;
    e[10].o = v[6];
    e[11].o = v[7];
    e[12].o = NULL;
    if (commit_tracked(q, &q->inflight, pid) < 0) return NULL;
    return PyLong_FromLongLong(pid);
}

HOT static PyObject *p2p_completed(Queue *q, PyObject *token) {
    if (!q->open) return not_recording();
    int64_t t, pid;
    if (stamp(q, &t) < 0) return NULL;
    int ok;
    if (as_int64(token, &pid)) {
        untrack(&q->inflight, pid);
        ok = push_id(q, TAG_P2P_DONE, t, pid);
    } else {
        ok = push_tuple(q, Py_BuildValue("(iLO)", TAG_P2P_DONE, (long long)t, token));
    }
    if (ok < 0) return NULL;
    Py_RETURN_NONE;
}

/* -- memory samples ----------------------------------------------------------------------- */

/* A list of exact int64 ints copied into ``out`` (at most ``room``): its length, or -1. */
HOT static Py_ssize_t read_ints(PyObject *list, int64_t *out, Py_ssize_t room) {
    if (!PyList_CheckExact(list) || PyList_GET_SIZE(list) > room) return -1;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(list); i++)
        if (!as_int64(PyList_GET_ITEM(list, i), &out[i])) return -1;
    return PyList_GET_SIZE(list);
}

COLD static PyObject *ints_list(const int64_t *ints, Py_ssize_t n) {
    PyObject *list = PyList_New(n);
    for (Py_ssize_t i = 0; list && i < n; i++) {
        PyObject *v = PyLong_FromLongLong(ints[i]);
        if (v == NULL) Py_CLEAR(list);
        else PyList_SET_ITEM(list, i, v);
    }
    return list;
}

/* The last sample as the Python recorder keeps it: (saved, inflight, allocator, swapped). */
COLD static PyObject *last_sample(Queue *q) {
    if (q->last_kind != 1) return Py_NewRef(q->last_sample ? q->last_sample : Py_None);
    PyObject *saved = ints_list(q->last_ints, q->last_saved);
    PyObject *inflight = ints_list(q->last_ints + q->last_saved, q->last_inflight);
    PyObject *sample = saved && inflight
                           ? PyTuple_Pack(4, saved, inflight, Py_None, Py_None)
                           : NULL;
    Py_XDECREF(saved);
    Py_XDECREF(inflight);
    return sample;
}

/* Whether ``sample`` (saved, inflight, allocator, swapped: the caller's objects) equals the
 * last one written: 1, 0, or -1 with an error set. */
COLD static int same_as_last(Queue *q, PyObject *sample) {
    PyObject *last = last_sample(q);
    int same = last ? PyObject_RichCompareBool(sample, last, Py_EQ) : -1;
    Py_XDECREF(last);
    return same;
}

COLD static PyObject *list_or_none(PyObject *value) {
    return value == Py_None ? Py_NewRef(value) : PySequence_List(value);
}

/* A sample of unusual values (an allocator's bytes, swapped bytes, not lists of ints):
 * compared and kept as the Python recorder does, as a tuple of copies. */
COLD static PyObject *memory_tuple(Queue *q, PyObject *sid, PyObject *sample, const int64_t *at) {
    int same = same_as_last(q, sample);
    if (same != 0) return same < 0 ? NULL : Py_NewRef(Py_None);
    PyObject *kept = Py_BuildValue("(NNON)", PySequence_List(PyTuple_GET_ITEM(sample, 0)),
                                   PySequence_List(PyTuple_GET_ITEM(sample, 1)),
                                   PyTuple_GET_ITEM(sample, 2),
                                   list_or_none(PyTuple_GET_ITEM(sample, 3)));
    if (kept == NULL) return NULL;
    Py_XSETREF(q->last_sample, kept);
    q->last_kind = 2;
    int64_t t;
    if (at) t = *at;
    else if (now(q, &t) < 0) return NULL;
    PyObject *record = Py_BuildValue("(iLOOOOO)", TAG_MEMORY, (long long)t, sid,
                                     PyTuple_GET_ITEM(kept, 0), PyTuple_GET_ITEM(kept, 1),
                                     PyTuple_GET_ITEM(kept, 2), PyTuple_GET_ITEM(kept, 3));
    if (push_tuple(q, record) < 0) return NULL;
    Py_RETURN_NONE;
}

/* Ints of a sample of lists of ints: the same as the last (1), or kept as the last (0). */
HOT static int same_ints(Queue *q, const int64_t *ints, Py_ssize_t saved, Py_ssize_t inflight) {
    Py_ssize_t n = saved + inflight, k = 0; /* a few ints: compared here, not by memcmp */
    if (q->last_kind == 1 && q->last_saved == saved && q->last_inflight == inflight) {
        while (k < n && q->last_ints[k] == ints[k]) k++;
        if (k == n) return 1;
    }
    q->last_kind = 1;
    q->last_saved = saved;
    q->last_inflight = inflight;
    for (k = 0; k < n; k++) q->last_ints[k] = ints[k];
    return 0;
}

/* A sample of ints (``saved`` then ``inflight`` in ``ints``) after step ``sid``: compared
 * with the last and written when it differs. */
HOT static PyObject *sample_ints(Queue *q, int64_t sid, const int64_t *ints, Py_ssize_t saved,
                                 Py_ssize_t inflight, const int64_t *at) {
    if (q->last_kind == 2) { /* the last was kept as a tuple: compared as Python does */
        PyObject *lists[2] = {ints_list(ints, saved), ints_list(ints + saved, inflight)};
        PyObject *sample = lists[0] && lists[1]
                               ? PyTuple_Pack(4, lists[0], lists[1], Py_None, Py_None)
                               : NULL;
        Py_XDECREF(lists[0]);
        Py_XDECREF(lists[1]);
        int same = sample ? same_as_last(q, sample) : -1;
        Py_XDECREF(sample);
        if (same != 0) return same < 0 ? NULL : Py_NewRef(Py_None);
    }
    if (same_ints(q, ints, saved, inflight)) Py_RETURN_NONE;
    int64_t t;
    if (at) t = *at;
    else if (now(q, &t) < 0) return NULL;
    Py_ssize_t n = 7 + saved + inflight;
    Cell *e = reserve(q, n);
    if (e == NULL) return NULL;
    e[0].i = HEADER(TAG_MEMORY, n);
    e[1].i = t;
    e[2].i = sid;
    e[3].i = RUN(7, saved);
    e[4].i = RUN(7 + saved, inflight);
    e[5].o = e[6].o = NULL;
    for (Py_ssize_t k = 0; k < saved + inflight; k++) e[7 + k].i = ints[k];
    if (commit(q) < 0) return NULL;
    Py_RETURN_NONE;
}

/* The step id of a token: the int itself, or the first item of a step's tuple token. */
HOT static PyObject *token_id(PyObject *token) {
    return PyTuple_CheckExact(token) && PyTuple_GET_SIZE(token) > 0 ? PyTuple_GET_ITEM(token, 0)
                                                                     : token;
}

/* memory_sample's work, its event at ``at`` (NULL: the clock read if one is written). */
HOT static PyObject *sample_at(Queue *q, PyObject *const *args, Py_ssize_t nargs,
                              const int64_t *at) {
    PyObject *allocator = nargs > 3 ? args[3] : Py_None, *swapped = nargs > 4 ? args[4] : Py_None;
    PyObject *sid = token_id(args[0]);
    int64_t ints[MAX_RUN], id;
    Py_ssize_t saved = -1, inflight = -1;
    if (allocator == Py_None && swapped == Py_None && as_int64(sid, &id)) {
        saved = read_ints(args[1], ints, MAX_RUN);
        inflight = saved < 0 ? -1 : read_ints(args[2], ints + saved, MAX_RUN - saved);
    }
    if (inflight >= 0) return sample_ints(q, id, ints, saved, inflight, at);
    /* unusual values: compared and kept as a tuple */
    PyObject *sample = PyTuple_Pack(4, args[1], args[2], allocator, swapped);
    PyObject *done = sample ? memory_tuple(q, sid, sample, at) : NULL;
    Py_XDECREF(sample);
    return done;
}

HOT static PyObject *memory_sample(Queue *q, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs < 3 || nargs > 5) {
        PyErr_SetString(PyExc_TypeError,
                        "memory_sample(token, saved, inflight, allocator=None, swapped=None)");
        return NULL;
    }
    if (!q->open) return not_recording();
    return sample_at(q, args, nargs, NULL);
}

static PyObject *watch_memory(Queue *q, PyObject *args) {
    PyObject *held, *act, *grad;
    if (!PyArg_ParseTuple(args, "O!O!O!:watch_memory", &PyList_Type, &held, &PyList_Type, &act,
                          &PyList_Type, &grad))
        return NULL;
    Py_XSETREF(q->held, Py_NewRef(held));
    Py_XSETREF(q->act, Py_NewRef(act));
    Py_XSETREF(q->grad, Py_NewRef(grad));
    Py_RETURN_NONE;
}

/* The watched counts as ints: per stage the sum of its held dict, then act + grad per
 * stage. 0 when a value is not an exact int64 (or the shapes differ): Python does it. */
HOT static int read_watched(Queue *q, int64_t *ints, Py_ssize_t *stages) {
    Py_ssize_t n = PyList_GET_SIZE(q->held);
    if (2 * n > MAX_RUN || PyList_GET_SIZE(q->act) != n || PyList_GET_SIZE(q->grad) != n) return 0;
    for (Py_ssize_t k = 0; k < n; k++) {
        PyObject *dict = PyList_GET_ITEM(q->held, k), *key, *value;
        Py_ssize_t pos = 0;
        int64_t sum = 0, v, a, g;
        if (!PyDict_CheckExact(dict)) return 0;
        while (PyDict_Next(dict, &pos, &key, &value))
            if (!as_int64(value, &v) || __builtin_add_overflow(sum, v, &sum)) return 0;
        if (!as_int64(PyList_GET_ITEM(q->act, k), &a) ||
            !as_int64(PyList_GET_ITEM(q->grad, k), &g) ||
            __builtin_add_overflow(a, g, &ints[n + k]))
            return 0;
        ints[k] = sum;
    }
    *stages = n;
    return 1;
}

/* The watched counts as Python computes them, for values `read_watched` does not take:
 * [sum(held.values()) for each stage] and list(map(add, act, grad)). */
COLD static PyObject *watched_saved(Queue *q) {
    Py_ssize_t n = PyList_GET_SIZE(q->held);
    PyObject *saved = PyList_New(n);
    for (Py_ssize_t k = 0; saved && k < n; k++) {
        PyObject *values = PyObject_CallMethod(PyList_GET_ITEM(q->held, k), "values", NULL);
        PyObject *total = values ? PyObject_CallFunctionObjArgs(s_sum, values, NULL) : NULL;
        Py_XDECREF(values);
        if (total == NULL) Py_CLEAR(saved);
        else PyList_SET_ITEM(saved, k, total);
    }
    return saved;
}

COLD static PyObject *watched_inflight(Queue *q) {
    Py_ssize_t n = Py_MIN(PyList_GET_SIZE(q->act), PyList_GET_SIZE(q->grad));
    PyObject *inflight = PyList_New(n);
    for (Py_ssize_t k = 0; inflight && k < n; k++) {
        PyObject *v = PyNumber_Add(PyList_GET_ITEM(q->act, k), PyList_GET_ITEM(q->grad, k));
        if (v == NULL) Py_CLEAR(inflight);
        else PyList_SET_ITEM(inflight, k, v);
    }
    return inflight;
}

/* sample_watched(token): the memory sample of the watched counts after the step of
 * ``token`` (see `Recorder.memory_watch`). */
/* The watched counts' sample after the step of ``token``, at ``at`` (see sample_at). */
HOT static PyObject *watched_at(Queue *q, PyObject *token, const int64_t *at) {
    if (q->held == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "sample_watched: watch_memory first");
        return NULL;
    }
    int64_t ints[MAX_RUN], id;
    Py_ssize_t stages;
    if (as_int64(token_id(token), &id) && read_watched(q, ints, &stages))
        return sample_ints(q, id, ints, stages, stages, at);
    PyObject *args[3] = {token, watched_saved(q), watched_inflight(q)};
    PyObject *done = args[1] && args[2] ? sample_at(q, args, 3, at) : NULL;
    Py_XDECREF(args[1]);
    Py_XDECREF(args[2]);
    return done;
}

HOT static PyObject *sample_watched(Queue *q, PyObject *token) {
    if (!q->open) return not_recording();
    return watched_at(q, token, NULL);
}

/* next_step(token, sampled, position, step): `end_step(token)`, then when ``sampled`` the
 * watched counts' sample after it, then `begin_step(position, step)`, all at one time: the
 * executor's one call between two steps of its loop instead of three (after a step's
 * framework work each call pays for the code and data it touches, docs/performance.md). A
 * None ``token``: nothing to end. */
HOT static PyObject *next_step(Queue *q, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "next_step(token, sampled, position, step)");
        return NULL;
    }
    if (!q->open) return not_recording();
    int64_t t;
    if (stamp(q, &t) < 0) return NULL;
    PyObject *token = args[0];
    if (token != Py_None) {
        int sampled = args[1] == Py_True ? 1 : args[1] == Py_False ? 0 : PyObject_IsTrue(args[1]);
        if (sampled < 0 || end_at(q, t, token, Py_None) < 0) return NULL;
        if (sampled) {
            PyObject *done = watched_at(q, token, &t);
            if (done == NULL) return NULL;
            Py_DECREF(done);
        }
    }
    return begin_at(q, t, args[2], args[3], s_main);
}

/* -- the object --------------------------------------------------------------------------- */

static PyObject *append_record(Queue *q, PyObject *record) {
    if (!q->open) return not_recording();
    if (push_tuple(q, Py_NewRef(record)) < 0) return NULL;
    Py_RETURN_NONE;
}

static PyObject *queue_open(Queue *q, PyObject *args, PyObject *kwargs) {
    static char *names[] = {"layouts",  "offset", "texts",    "text",    "literals",
                            "peers",    "fallback", "capacity", "on_full", NULL};
    PyObject *spec, *texts, *text, *literals, *peers, *fallback, *on_full;
    long long offset, capacity;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "O!LO!OO!OOLO:open", names, &PyTuple_Type,
                                     &spec, &offset, &PyDict_Type, &texts, &text, &PyDict_Type,
                                     &literals, &peers, &fallback, &capacity, &on_full))
        return NULL;
    q->open = 0;
    if (lines_open(&q->lines, spec, offset, texts, text, literals, peers, fallback) < 0)
        return NULL;
    q->open = 1;
    q->capacity = capacity;
    Py_XSETREF(q->on_full, on_full == Py_None ? NULL : Py_NewRef(on_full));
    Py_RETURN_NONE;
}

static PyObject *queue_close(Queue *q, PyObject *unused) {
    q->open = 0; /* the hot calls refuse; what waits can still be taken */
    Py_RETURN_NONE;
}

static int queue_init(Queue *q, PyObject *args, PyObject *kwargs) {
    static char *names[] = {"clock", "step_token", "close_token", NULL};
    PyObject *clock, *step_token, *close_token;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOO:EventQueue", names, &clock, &step_token,
                                     &close_token))
        return -1;
    Py_XSETREF(q->clock, clock == Py_None ? NULL : Py_NewRef(clock));
    Py_XSETREF(q->step_token, Py_NewRef(step_token));
    Py_XSETREF(q->close_token, Py_NewRef(close_token));
    return 0;
}

static int queue_traverse(Queue *q, visitproc visit, void *arg) {
    for (Py_ssize_t at = q->head; at < q->tail; at += HEADER_LENGTH(q->cells[at].i)) {
        int failed = entry_visit(q->cells + at, visit, arg);
        if (failed) return failed;
    }
    TrackSet *sets[] = {&q->open_steps, &q->inflight};
    for (int k = 0; k < 2; k++) {
        for (Py_ssize_t i = 0; i < sets[k]->len; i++) {
            if (sets[k]->items[i].id < 0) continue;
            int failed = entry_visit(sets[k]->items[i].cells, visit, arg);
            if (failed) return failed;
        }
    }
    Py_VISIT(q->on_full);
    Py_VISIT(q->clock);
    Py_VISIT(q->step_token);
    Py_VISIT(q->close_token);
    Py_VISIT(q->last_sample);
    Py_VISIT(q->held);
    Py_VISIT(q->act);
    Py_VISIT(q->grad);
    return lines_traverse(&q->lines, visit, arg);
}

static int queue_clear(Queue *q) {
    q->open = 0;
    release_all(q);
    track_clear(&q->open_steps);
    track_clear(&q->inflight);
    lines_clear(&q->lines);
    Py_CLEAR(q->on_full);
    Py_CLEAR(q->clock);
    Py_CLEAR(q->step_token);
    Py_CLEAR(q->close_token);
    Py_CLEAR(q->last_sample);
    Py_CLEAR(q->held);
    Py_CLEAR(q->act);
    Py_CLEAR(q->grad);
    return 0;
}

static void queue_dealloc(Queue *q) {
    PyObject_GC_UnTrack(q);
    queue_clear(q);
    PyMem_Free(q->cells);
    PyMem_Free(q->out.data);
    Py_TYPE(q)->tp_free((PyObject *)q);
}

static PyMethodDef queue_methods[] = {
    {"begin_step", (PyCFunction)(void (*)(void))begin_step, METH_FASTCALL, NULL},
    {"end_step", (PyCFunction)(void (*)(void))end_step, METH_FASTCALL, NULL},
    {"p2p_posted", (PyCFunction)(void (*)(void))p2p_posted, METH_FASTCALL | METH_KEYWORDS, NULL},
    {"p2p_completed", (PyCFunction)p2p_completed, METH_O, NULL},
    {"memory_sample", (PyCFunction)(void (*)(void))memory_sample, METH_FASTCALL, NULL},
    {"watch_memory", (PyCFunction)watch_memory, METH_VARARGS,
     "watch_memory(held, act, grad): the counts sample_watched reads"},
    {"sample_watched", (PyCFunction)sample_watched, METH_O,
     "sample_watched(token): memory_sample of the watched counts"},
    {"next_step", (PyCFunction)(void (*)(void))next_step, METH_FASTCALL,
     "next_step(token, sampled, position, step): end, sample, begin at one time"},
    {"append", (PyCFunction)append_record, METH_O, "append(record): a record tuple, in order"},
    {"write", (PyCFunction)(void (*)(void))write_lines, METH_FASTCALL,
     "write(fd, n): the first n entries written to fd as their lines"},
    {"open_steps", (PyCFunction)open_steps, METH_NOARGS, "{id: step_begin record}"},
    {"inflight", (PyCFunction)inflight, METH_NOARGS, "{id: p2p_post record}"},
    {"open", (PyCFunction)(void (*)(void))queue_open, METH_VARARGS | METH_KEYWORDS,
     "open(layouts, offset, texts, text, literals, peers, fallback, capacity, on_full)"},
    {"close", (PyCFunction)queue_close, METH_NOARGS, "the hot calls refuse from now on"},
    {NULL, NULL, 0, NULL},
};

static PyMemberDef queue_members[] = {
    {"iteration", T_LONGLONG, offsetof(Queue, iteration), 0, "the iteration events belong to"},
    {"progress", T_LONGLONG, offsetof(Queue, progress), 0, "the last hot call's time"},
    {"profiling", T_INT, offsetof(Queue, profiling), 0,
     "whether begin_step opens a profiler range (step_token) this iteration"},
    {NULL},
};

static PySequenceMethods queue_sequence = {.sq_length = (lenfunc)queue_length};

static PyTypeObject QueueType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "pipetrace.recorder._queue.EventQueue",
    .tp_basicsize = sizeof(Queue),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "EventQueue(clock, step_token, close_token): a rank's events until "
              "they are written (see the module's source)",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)queue_init,
    .tp_traverse = (traverseproc)queue_traverse,
    .tp_clear = (inquiry)queue_clear,
    .tp_dealloc = (destructor)queue_dealloc,
    .tp_methods = queue_methods,
    .tp_members = queue_members,
    .tp_as_sequence = &queue_sequence,
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_queue", NULL, -1, NULL};

PyMODINIT_FUNC PyInit__queue(void) {
    if ((s_main = PyUnicode_InternFromString("main")) == NULL) return NULL;
    PyObject *builtins = PyImport_ImportModule("builtins");
    s_sum = builtins ? PyObject_GetAttrString(builtins, "sum") : NULL;
    Py_XDECREF(builtins);
    if (s_sum == NULL) return NULL;
    for (int i = 0; i < NPOST; i++)
        if ((post_keys[i] = PyUnicode_InternFromString(post_names[i])) == NULL) return NULL;
    entries_init();
    if (PyType_Ready(&QueueType) < 0) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    if (PyModule_AddObjectRef(m, "EventQueue", (PyObject *)&QueueType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
