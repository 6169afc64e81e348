/* Encoding the recorder's hot records into their event lines, in C.
 *
 * The recorder's hot path appends one tuple per event; its writer thread turns a batch of
 * them into JSON lines. In Python that costs ~1 µs per event, and with 4 ranks on 2 cores
 * that encoding, done under the interpreter lock, was most of what recording cost a
 * training step (docs/performance.md, "Recorder"). `encode` writes the same bytes at a
 * fraction of the cost.
 *
 * It knows nothing of the trace format: the caller describes each hot record type as the
 * texts of its line (`pipetrace.recorder.format.template_parts`) and, for each value, the
 * tuple index it comes from and how to write it (`Slot` kinds below). A record that does not
 * fit its description exactly (another length, a value of another type, an int beyond
 * int64) and every record of another type go to the caller's fallback, the Python encoder,
 * so the output never depends on which encoder wrote a line.
 *
 * The Python side is `pipetrace/recorder/encoding.py`.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

enum {
    K_INT = 0,     /* an int, written in decimal */
    K_TIME = 1,    /* an int plus the caller's offset (monotonic -> epoch) */
    K_TEXT = 2,    /* a step: its cached JSON text, by id(), else the caller's text(step) */
    K_LITERAL = 3, /* a str: its JSON literal from the caller's literals mapping */
    K_PEER = 4,    /* an int, through the caller's peers sequence when there is one */
    K_SHAPE = 5,   /* a tuple or list of ints: literals[tuple(value)] */
    K_INTS = 6,    /* a list of ints, written as orjson does: [1,2,3] */
    K_NONE = 7,    /* must be None; writes nothing (an optional field left out) */
};
#define MAX_SLOTS 24
#define MAX_TYPES 16

typedef struct {
    const char *text; /* written before the value */
    Py_ssize_t text_len;
    Py_ssize_t index; /* in the record */
    int kind;
} Slot;

typedef struct {
    int known;
    Py_ssize_t length; /* of the record tuple */
    Slot slots[MAX_SLOTS];
    int nslots;
    const char *tail; /* after the last value, newline included */
    Py_ssize_t tail_len;
} Layout;

typedef struct {
    char *data;
    Py_ssize_t len, cap;
} Buffer;

static int reserve(Buffer *b, Py_ssize_t more) {
    if (b->len + more <= b->cap) return 1;
    Py_ssize_t cap = b->cap ? b->cap : 4096;
    while (cap < b->len + more) cap *= 2;
    char *data = PyMem_Realloc(b->data, (size_t)cap);
    if (data == NULL) {
        PyErr_NoMemory();
        return 0;
    }
    b->data = data;
    b->cap = cap;
    return 1;
}

static int put(Buffer *b, const char *text, Py_ssize_t len) {
    if (!reserve(b, len)) return 0;
    memcpy(b->data + b->len, text, (size_t)len);
    b->len += len;
    return 1;
}

static int put_int(Buffer *b, int64_t value) {
    char digits[24];
    int n = 0;
    uint64_t v = value < 0 ? (uint64_t)0 - (uint64_t)value : (uint64_t)value;
    do {
        digits[n++] = (char)('0' + v % 10);
        v /= 10;
    } while (v);
    if (!reserve(b, n + 1)) return 0;
    if (value < 0) b->data[b->len++] = '-';
    while (n) b->data[b->len++] = digits[--n];
    return 1;
}

/* An exact int within int64 (a bool, a subclass or a bigger int: no, the fallback writes it). */
static int as_int64(PyObject *value, int64_t *out) {
    if (!PyLong_CheckExact(value)) return 0;
    int overflow = 0;
    long long v = PyLong_AsLongLongAndOverflow(value, &overflow);
    if (overflow || (v == -1 && PyErr_Occurred())) {
        PyErr_Clear();
        return 0;
    }
    *out = (int64_t)v;
    return 1;
}

/* The bytes the caller's mapping gives for ``key`` (a dict subclass: __missing__ may run). */
static int put_mapped(Buffer *b, PyObject *mapping, PyObject *key) {
    PyObject *found = PyDict_GetItemWithError(mapping, key); /* borrowed */
    PyObject *owned = NULL;
    if (found == NULL) {
        if (PyErr_Occurred()) return -1;
        found = owned = PyObject_GetItem(mapping, key);
        if (found == NULL) return -1;
    }
    int ok = PyBytes_CheckExact(found) &&
             put(b, PyBytes_AS_STRING(found), PyBytes_GET_SIZE(found));
    Py_XDECREF(owned);
    if (!ok && PyErr_Occurred()) return -1;
    return ok;
}

typedef struct {
    int64_t offset;
    PyObject *texts, *text, *literals, *peers;
} Context;

static int put_text(Buffer *b, const Context *c, PyObject *step) {
    PyObject *key = PyLong_FromVoidPtr(step);
    if (key == NULL) return -1;
    PyObject *found = PyDict_GetItemWithError(c->texts, key); /* borrowed */
    Py_DECREF(key);
    PyObject *owned = NULL;
    if (found == NULL) {
        if (PyErr_Occurred()) return -1;
        found = owned = PyObject_CallOneArg(c->text, step);
        if (found == NULL) return -1;
    }
    int ok = PyBytes_CheckExact(found) &&
             put(b, PyBytes_AS_STRING(found), PyBytes_GET_SIZE(found));
    Py_XDECREF(owned);
    if (!ok && PyErr_Occurred()) return -1;
    return ok;
}

static int put_ints(Buffer *b, PyObject *value) {
    if (!PyList_CheckExact(value)) return 0;
    if (!put(b, "[", 1)) return -1;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(value); i++) {
        int64_t v;
        if (!as_int64(PyList_GET_ITEM(value, i), &v)) return 0;
        if ((i && !put(b, ",", 1)) || !put_int(b, v)) return -1;
    }
    return put(b, "]", 1) ? 1 : -1;
}

static int put_shape(Buffer *b, const Context *c, PyObject *value) {
    if (PyTuple_CheckExact(value)) return put_mapped(b, c->literals, value);
    if (!PyList_CheckExact(value) && !PyTuple_Check(value)) return 0; /* torch.Size: a tuple */
    PyObject *shape = PySequence_Tuple(value);
    if (shape == NULL) return -1;
    int ok = put_mapped(b, c->literals, shape);
    Py_DECREF(shape);
    return ok;
}

static int put_peer(Buffer *b, const Context *c, PyObject *value) {
    int64_t v;
    if (c->peers == Py_None) return as_int64(value, &v) ? (put_int(b, v) ? 1 : -1) : 0;
    if (!PyLong_CheckExact(value)) return 0;
    PyObject *peer = PyObject_GetItem(c->peers, value);
    if (peer == NULL) {
        PyErr_Clear(); /* the fallback meets the same error and raises it */
        return 0;
    }
    int ok = as_int64(peer, &v);
    Py_DECREF(peer);
    return ok ? (put_int(b, v) ? 1 : -1) : 0;
}

/* One value: 1 written, 0 does not fit (the record goes to the fallback), -1 error. */
static int put_value(Buffer *b, const Context *c, int kind, PyObject *value) {
    int64_t v;
    switch (kind) {
    case K_INT:
        return as_int64(value, &v) ? (put_int(b, v) ? 1 : -1) : 0;
    case K_TIME:
        if (!as_int64(value, &v) || __builtin_add_overflow(v, c->offset, &v)) return 0;
        return put_int(b, v) ? 1 : -1;
    case K_TEXT:
        return put_text(b, c, value);
    case K_LITERAL:
        return PyUnicode_CheckExact(value) ? put_mapped(b, c->literals, value) : 0;
    case K_PEER:
        return put_peer(b, c, value);
    case K_SHAPE:
        return put_shape(b, c, value);
    case K_INTS:
        return put_ints(b, value);
    case K_NONE:
        return value == Py_None;
    }
    return 0;
}

/* A record's line: 1 written, 0 not this layout's (nothing written), -1 error. */
static int put_record(Buffer *b, const Context *c, const Layout *layout, PyObject *record) {
    Py_ssize_t start = b->len;
    for (int i = 0; i < layout->nslots; i++) {
        const Slot *s = &layout->slots[i];
        if (!put(b, s->text, s->text_len)) return -1;
        int ok = put_value(b, c, s->kind, PyTuple_GET_ITEM(record, s->index));
        if (ok != 1) {
            b->len = start;
            return ok;
        }
    }
    return put(b, layout->tail, layout->tail_len) ? 1 : -1;
}

/* The layouts argument: a tuple indexed by record tag, each None or
 * (length, ((text, index, kind), ...), tail). Its bytes stay referenced by the caller. */
static int read_layouts(PyObject *spec, Layout *layouts, int *count) {
    if (!PyTuple_Check(spec) || PyTuple_GET_SIZE(spec) > MAX_TYPES) {
        PyErr_SetString(PyExc_ValueError, "layouts: a tuple of at most 16 entries");
        return 0;
    }
    *count = (int)PyTuple_GET_SIZE(spec);
    for (int tag = 0; tag < *count; tag++) {
        Layout *l = &layouts[tag];
        PyObject *entry = PyTuple_GET_ITEM(spec, tag), *slots;
        l->known = entry != Py_None;
        if (!l->known) continue;
        if (!PyArg_ParseTuple(entry, "nO!y#", &l->length, &PyTuple_Type, &slots, &l->tail,
                              &l->tail_len))
            return 0;
        l->nslots = (int)PyTuple_GET_SIZE(slots);
        if (l->nslots > MAX_SLOTS) {
            PyErr_SetString(PyExc_ValueError, "layouts: too many values in a line");
            return 0;
        }
        for (int i = 0; i < l->nslots; i++) {
            Slot *s = &l->slots[i];
            if (!PyArg_ParseTuple(PyTuple_GET_ITEM(slots, i), "y#ni", &s->text, &s->text_len,
                                  &s->index, &s->kind))
                return 0;
            if (s->index < 0 || s->index >= l->length || s->kind < K_INT || s->kind > K_NONE) {
                PyErr_SetString(PyExc_ValueError, "layouts: a value outside its record");
                return 0;
            }
        }
    }
    return 1;
}

/* A record of a described type that fits: its line is written; else fallback(record)'s. */
static int encode_one(Buffer *b, const Context *c, const Layout *layouts, int count,
                      PyObject *fallback, PyObject *record) {
    if (PyTuple_CheckExact(record) && PyTuple_GET_SIZE(record) > 0) {
        int64_t tag;
        if (as_int64(PyTuple_GET_ITEM(record, 0), &tag) && tag >= 0 && tag < count &&
            layouts[tag].known && PyTuple_GET_SIZE(record) == layouts[tag].length) {
            int ok = put_record(b, c, &layouts[tag], record);
            if (ok) return ok;
        }
    }
    PyObject *line = PyObject_CallOneArg(fallback, record);
    if (line == NULL) return -1;
    Py_buffer view;
    int ok = PyObject_GetBuffer(line, &view, PyBUF_SIMPLE) == 0;
    if (ok) {
        ok = put(b, view.buf, view.len);
        PyBuffer_Release(&view);
    }
    Py_DECREF(line);
    return ok ? 1 : -1;
}

static PyObject *encode(PyObject *self, PyObject *args) {
    PyObject *records, *spec, *fallback;
    Context c;
    long long offset;
    if (!PyArg_ParseTuple(args, "O!OLO!OO!OO", &PyList_Type, &records, &spec, &offset,
                          &PyDict_Type, &c.texts, &c.text, &PyDict_Type, &c.literals, &c.peers,
                          &fallback))
        return NULL;
    c.offset = offset;
    Layout layouts[MAX_TYPES];
    int count;
    if (!read_layouts(spec, layouts, &count)) return NULL;
    Buffer b = {NULL, 0, 0};
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(records); i++) {
        PyObject *record = PyList_GET_ITEM(records, i);
        Py_INCREF(record); /* the fallback may change the list */
        int ok = encode_one(&b, &c, layouts, count, fallback, record);
        Py_DECREF(record);
        if (ok < 0) {
            PyMem_Free(b.data);
            return NULL;
        }
    }
    PyObject *out = PyBytes_FromStringAndSize(b.data, b.len);
    PyMem_Free(b.data);
    return out;
}

static PyMethodDef methods[] = {
    {"encode", encode, METH_VARARGS,
     "encode(records, layouts, offset, texts, text, literals, peers, fallback) -> bytes"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_encode", NULL, -1, methods};

PyMODINIT_FUNC PyInit__encode(void) { return PyModule_Create(&module); }
