/* The recorder's hot calls in C: a step's begin and end, a P2P op's post and completion, a
 * memory sample.
 *
 * Each is what `Recorder`'s Python method of the same name does (pipetrace/recorder/
 * recorder.py, the plain case: no device timer, no stacks), without the interpreter's frame
 * and bytecode per call. Inside a training step that matters more than a loop over the calls
 * shows: between two calls the framework's work evicts the recorder's code and data from
 * the CPU's caches, and a Python call touches many more of them (docs/performance.md,
 * "Recorder").
 *
 * It keeps no state of its own but the last memory sample: it reads the recorder's attributes
 * it needs (`_iteration`, `_append`, `_append_unchecked`) from the recorder's `__dict__` on
 * every call, writes `last_progress` there, and shares the recorder's `open_steps`, `inflight`
 * and id counter, so the Python side (watchdog, stall dumps, `begin_run`) sees one recorder.
 * A step with a profiler range open goes through the recorder's own `_step_token` and
 * `_close_token`. tests/recorder/test_hotpath.py holds both implementations to the same
 * events and state.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

enum { TAG_STEP_BEGIN, TAG_STEP_END, TAG_P2P_POST, TAG_P2P_DONE, TAG_MEMORY, NTAGS };

typedef struct {
    PyObject_HEAD
    PyObject *state;      /* the recorder's __dict__ */
    PyObject *clock;      /* () -> monotonic ns */
    PyObject *ids;        /* the recorder's itertools.count */
    PyObject *open_steps; /* id -> step_begin record */
    PyObject *inflight;   /* id -> p2p_post record */
    PyObject *active;     /* None, or () -> whether a profiler wants ranges now */
    PyObject *step_token; /* (sid, step) -> the token of a step with a range open */
    PyObject *close_token; /* (token) -> its step's id, the range closed */
    PyObject *tags[NTAGS];
    PyObject *last_memory; /* the last memory sample written */
    unsigned ends;         /* steps ended: every CHECK_EVERY-th end checks the queue's bound */
} Hot;

/* The writer's bound (`EventWriter.append`, a Python frame) is checked at every 32nd step
 * end, not at every one as the Python method does: the queue then exceeds it by at most a
 * few hundred events (of 200,000 by default). */
#define CHECK_EVERY 32

static PyObject *s_last_progress, *s_iteration, *s_append, *s_append_unchecked, *s_main;

/* The clock's reading, also stored as the recorder's last_progress. */
static PyObject *progress(Hot *self) {
    PyObject *t = PyObject_CallNoArgs(self->clock);
    if (t != NULL && PyDict_SetItem(self->state, s_last_progress, t) < 0) Py_CLEAR(t);
    return t;
}

/* A recorder attribute, borrowed. */
static PyObject *attr(Hot *self, PyObject *name) {
    PyObject *value = PyDict_GetItemWithError(self->state, name);
    if (value == NULL && !PyErr_Occurred()) PyErr_SetObject(PyExc_AttributeError, name);
    return value;
}

/* append(record), stealing the record; 0 or -1. */
static int append(Hot *self, PyObject *name, PyObject *record) {
    if (record == NULL) return -1;
    PyObject *function = attr(self, name);
    PyObject *done = function ? PyObject_CallOneArg(function, record) : NULL;
    Py_DECREF(record);
    if (done == NULL) return -1;
    Py_DECREF(done);
    return 0;
}

static int forget(PyObject *dict, PyObject *key) {
    int present = PyDict_Contains(dict, key);
    return present > 0 ? PyDict_DelItem(dict, key) : present;
}

static PyObject *begin_step(Hot *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs < 2 || nargs > 3) {
        PyErr_SetString(PyExc_TypeError, "begin_step(position, step, thread='main')");
        return NULL;
    }
    PyObject *step = args[1], *thread = nargs == 3 ? args[2] : NULL;
    PyObject *iteration = attr(self, s_iteration);
    if (iteration == NULL) return NULL;
    PyObject *t = progress(self);
    if (t == NULL) return NULL;
    PyObject *sid = PyIter_Next(self->ids);
    if (sid == NULL) {
        Py_DECREF(t);
        return NULL;
    }
    PyObject *record = PyTuple_Pack(7, self->tags[TAG_STEP_BEGIN], t, sid, iteration, args[0],
                                    step, thread ? thread : s_main);
    Py_DECREF(t);
    if (record == NULL || PyDict_SetItem(self->open_steps, sid, record) < 0) {
        Py_XDECREF(record);
        Py_DECREF(sid);
        return NULL;
    }
    if (append(self, s_append_unchecked, record) < 0) {
        Py_DECREF(sid);
        return NULL;
    }
    if (self->active == Py_None) return sid;
    PyObject *active = PyObject_CallNoArgs(self->active);
    int wanted = active ? PyObject_IsTrue(active) : -1;
    Py_XDECREF(active);
    if (wanted <= 0) {
        if (wanted < 0) Py_CLEAR(sid);
        return sid;
    }
    PyObject *token = PyObject_CallFunctionObjArgs(self->step_token, sid, step, NULL);
    Py_DECREF(sid);
    return token;
}

static PyObject *end_step(Hot *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs < 1 || nargs > 2) {
        PyErr_SetString(PyExc_TypeError, "end_step(token, nbytes=None)");
        return NULL;
    }
    PyObject *t = progress(self);
    if (t == NULL) return NULL;
    PyObject *sid = PyTuple_CheckExact(args[0]) ? PyObject_CallOneArg(self->close_token, args[0])
                                                : Py_NewRef(args[0]);
    PyObject *record = NULL;
    if (sid != NULL && forget(self->open_steps, sid) >= 0) {
        PyObject *tag = self->tags[TAG_STEP_END];
        record = nargs == 2 && args[1] != Py_None ? PyTuple_Pack(4, tag, t, sid, args[1])
                                                  : PyTuple_Pack(3, tag, t, sid);
    }
    Py_XDECREF(sid);
    Py_DECREF(t);
    PyObject *name = ++self->ends % CHECK_EVERY ? s_append_unchecked : s_append;
    if (record == NULL || append(self, name, record) < 0) return NULL;
    Py_RETURN_NONE;
}

static const char *const post_names[] = {"op",    "step",   "peer",  "channel", "seq",
                                         "nbytes", "shape", "dtype", "stream"};
#define NPOST 9
static PyObject *post_keys[NPOST]; /* interned: a call site's keywords are the same objects */

/* The index of a keyword in post_names, NPOST if none. */
static int post_index(PyObject *name, Py_ssize_t k) {
    if (k < NPOST && name == post_keys[k]) return (int)k; /* the usual order */
    for (int i = 0; i < NPOST; i++)
        if (name == post_keys[i]) return i;
    for (int i = 0; i < NPOST; i++)
        if (PyUnicode_CompareWithASCIIString(name, post_names[i]) == 0) return i;
    return NPOST;
}

/* p2p_posted's keyword-only arguments in post_names' order; stream may be absent. */
static int post_arguments(PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames,
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

static PyObject *p2p_posted(Hot *self, PyObject *const *args, Py_ssize_t nargs,
                            PyObject *kwnames) {
    PyObject *v[NPOST];
    if (post_arguments(args, nargs, kwnames, v) < 0) return NULL;
    PyObject *iteration = attr(self, s_iteration);
    if (iteration == NULL) return NULL;
    PyObject *t = progress(self);
    if (t == NULL) return NULL;
    PyObject *pid = PyIter_Next(self->ids);
    PyObject *record = pid ? PyTuple_Pack(13, self->tags[TAG_P2P_POST], t, pid, iteration, v[0],
                                          v[1], v[2], v[3], v[4], v[5], v[6], v[7], Py_None)
                           : NULL;
    Py_DECREF(t);
    if (record == NULL || PyDict_SetItem(self->inflight, pid, record) < 0) {
        Py_XDECREF(record);
        Py_XDECREF(pid);
        return NULL;
    }
    if (append(self, s_append_unchecked, record) < 0) Py_CLEAR(pid);
    return pid;
}

static PyObject *p2p_completed(Hot *self, PyObject *token) {
    PyObject *t = progress(self);
    if (t == NULL) return NULL;
    PyObject *record = NULL;
    if (forget(self->inflight, token) >= 0)
        record = PyTuple_Pack(3, self->tags[TAG_P2P_DONE], t, token);
    Py_DECREF(t);
    if (append(self, s_append_unchecked, record) < 0) return NULL;
    Py_RETURN_NONE;
}

static PyObject *memory_sample(Hot *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs < 4 || nargs > 5) {
        PyErr_SetString(PyExc_TypeError,
                        "memory_sample(token, saved, inflight, allocator, swapped=None)");
        return NULL;
    }
    PyObject *swapped = nargs == 5 ? args[4] : Py_None;
    PyObject *sample = PyTuple_Pack(4, args[1], args[2], args[3], swapped);
    if (sample == NULL) return NULL;
    int same = PyObject_RichCompareBool(sample, self->last_memory, Py_EQ);
    if (same != 0) {
        Py_DECREF(sample);
        if (same < 0) return NULL;
        Py_RETURN_NONE;
    }
    Py_SETREF(self->last_memory, sample);
    PyObject *token = args[0];
    PyObject *sid = PyTuple_CheckExact(token) && PyTuple_GET_SIZE(token) > 0
                        ? PyTuple_GET_ITEM(token, 0)
                        : token;
    PyObject *t = PyObject_CallNoArgs(self->clock);
    if (t == NULL) return NULL;
    PyObject *record = PyTuple_Pack(7, self->tags[TAG_MEMORY], t, sid, args[1], args[2], args[3],
                                    swapped);
    Py_DECREF(t);
    if (append(self, s_append_unchecked, record) < 0) return NULL;
    Py_RETURN_NONE;
}

static int hot_init(Hot *self, PyObject *args, PyObject *kwargs) {
    PyObject *tags;
    if (!PyArg_ParseTuple(args, "O!OOO!O!OOOO!:HotPath", &PyDict_Type, &self->state, &self->clock,
                          &self->ids, &PyDict_Type, &self->open_steps, &PyDict_Type,
                          &self->inflight, &self->active, &self->step_token, &self->close_token,
                          &PyTuple_Type, &tags))
        return -1;
    if (PyTuple_GET_SIZE(tags) != NTAGS) {
        PyErr_SetString(PyExc_ValueError, "HotPath: five record tags");
        return -1;
    }
    PyObject **fields[] = {&self->state,    &self->clock,      &self->ids,
                           &self->open_steps, &self->inflight, &self->active,
                           &self->step_token, &self->close_token};
    for (size_t i = 0; i < sizeof fields / sizeof *fields; i++) Py_INCREF(*fields[i]);
    for (int i = 0; i < NTAGS; i++) self->tags[i] = Py_NewRef(PyTuple_GET_ITEM(tags, i));
    self->last_memory = PyTuple_New(0);
    return self->last_memory ? 0 : -1;
}

static int hot_traverse(Hot *self, visitproc visit, void *arg) {
    Py_VISIT(self->state);
    Py_VISIT(self->clock);
    Py_VISIT(self->ids);
    Py_VISIT(self->open_steps);
    Py_VISIT(self->inflight);
    Py_VISIT(self->active);
    Py_VISIT(self->step_token);
    Py_VISIT(self->close_token);
    for (int i = 0; i < NTAGS; i++) Py_VISIT(self->tags[i]);
    Py_VISIT(self->last_memory);
    return 0;
}

static int hot_clear(Hot *self) {
    Py_CLEAR(self->state);
    Py_CLEAR(self->clock);
    Py_CLEAR(self->ids);
    Py_CLEAR(self->open_steps);
    Py_CLEAR(self->inflight);
    Py_CLEAR(self->active);
    Py_CLEAR(self->step_token);
    Py_CLEAR(self->close_token);
    for (int i = 0; i < NTAGS; i++) Py_CLEAR(self->tags[i]);
    Py_CLEAR(self->last_memory);
    return 0;
}

static void hot_dealloc(Hot *self) {
    PyObject_GC_UnTrack(self);
    hot_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyMethodDef hot_methods[] = {
    {"begin_step", (PyCFunction)(void (*)(void))begin_step, METH_FASTCALL, NULL},
    {"end_step", (PyCFunction)(void (*)(void))end_step, METH_FASTCALL, NULL},
    {"p2p_posted", (PyCFunction)(void (*)(void))p2p_posted, METH_FASTCALL | METH_KEYWORDS, NULL},
    {"p2p_completed", (PyCFunction)p2p_completed, METH_O, NULL},
    {"memory_sample", (PyCFunction)(void (*)(void))memory_sample, METH_FASTCALL, NULL},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject HotType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "pipetrace.recorder._hotpath.HotPath",
    .tp_basicsize = sizeof(Hot),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "HotPath(state, clock, ids, open_steps, inflight, active, step_token, "
              "close_token, tags): a recorder's hot calls (see the module's source)",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)hot_init,
    .tp_traverse = (traverseproc)hot_traverse,
    .tp_clear = (inquiry)hot_clear,
    .tp_dealloc = (destructor)hot_dealloc,
    .tp_methods = hot_methods,
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_hotpath", NULL, -1, NULL};

PyMODINIT_FUNC PyInit__hotpath(void) {
    s_last_progress = PyUnicode_InternFromString("last_progress");
    s_iteration = PyUnicode_InternFromString("_iteration");
    s_append = PyUnicode_InternFromString("_append");
    s_append_unchecked = PyUnicode_InternFromString("_append_unchecked");
    s_main = PyUnicode_InternFromString("main");
    if (!s_last_progress || !s_iteration || !s_append || !s_append_unchecked || !s_main)
        return NULL;
    for (int i = 0; i < NPOST; i++)
        if ((post_keys[i] = PyUnicode_InternFromString(post_names[i])) == NULL) return NULL;
    if (PyType_Ready(&HotType) < 0) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    if (PyModule_AddObjectRef(m, "HotPath", (PyObject *)&HotType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
