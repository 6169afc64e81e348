/* The queue's entries written as event lines (the entries: _queue.h).
 *
 * It knows nothing of the trace format: the caller describes each hot record type as the
 * texts of its line (`pipetrace.recorder.format.template_parts`) and, for each value, the
 * record index it comes from and how to write it (the kinds below). An entry whose values
 * do not fit its description exactly (a value of another type, an int beyond int64, a
 * record of another length or type) goes to the caller's fallback, the Python encoder, as
 * its record tuple, so the output never depends on which encoder wrote a line.
 *
 * The Python side is `pipetrace/recorder/encoding.py`; tests/recorder/test_encoding.py holds
 * both to the same lines.
 */
#include "_queue.h"

#include <string.h>

enum {
    K_INT = 0,     /* an int, written in decimal */
    K_TIME = 1,    /* an int plus the offset (monotonic -> epoch) */
    K_TEXT = 2,    /* a step: its JSON text, from the texts cache or text(step) */
    K_LITERAL = 3, /* a str: its JSON literal from the literals mapping */
    K_PEER = 4,    /* an int, through peers when there are */
    K_SHAPE = 5,   /* a tuple or list of ints: literals[tuple(value)] */
    K_INTS = 6,    /* a list of ints (in cells: a run), written as orjson does: [1,2,3] */
    K_NONE = 7,    /* must be None; writes nothing (an optional field left out) */
};

const char *const CELLS[NTAGS] = {
    [TAG_STEP_BEGIN] = "hiiiioo", /* t, id, it, pos, step, thread */
    [TAG_STEP_END] = "hii",       /* t, id */
    [TAG_P2P_POST] = "hiiiooioiiooo", /* t, id, it, op, step, peer, channel, seq, bytes,
                                         shape, dtype, stack */
    [TAG_P2P_DONE] = "hii",           /* t, id */
    [TAG_OTHER] = NULL,
    [TAG_MEMORY] = "hiirroo", /* t, id, saved, inflight, allocator, swapped */
};

/* -- entries ------------------------------------------------------------------------------ */

/* Per tag, the cells holding an object (bit i: cell i), from CELLS; a tuple's is cell 1. */
static uint64_t object_cells[NTAGS];

void entries_init(void) {
    for (int tag = 0; tag < NTAGS; tag++)
        for (int i = 1; CELLS[tag] && CELLS[tag][i]; i++)
            if (CELLS[tag][i] == 'o') object_cells[tag] |= (uint64_t)1 << i;
}

HOT static uint64_t objects_of(const Cell *e) {
    int tag = HEADER_TAG(e[0].i);
    return tag == TAG_TUPLE ? (uint64_t)1 << 1 : object_cells[tag];
}

HOT void entry_incref(const Cell *e) {
    for (uint64_t objects = objects_of(e); objects; objects &= objects - 1)
        Py_XINCREF(e[__builtin_ctzll(objects)].o);
}

HOT void entry_decref(const Cell *e) {
    for (uint64_t objects = objects_of(e); objects; objects &= objects - 1)
        Py_XDECREF(e[__builtin_ctzll(objects)].o);
}

int entry_visit(const Cell *e, visitproc visit, void *arg) {
    for (uint64_t objects = objects_of(e); objects; objects &= objects - 1)
        Py_VISIT(e[__builtin_ctzll(objects)].o);
    return 0;
}

static PyObject *run_list(const Cell *e, int64_t run) {
    PyObject *list = PyList_New(RUN_COUNT(run));
    for (Py_ssize_t k = 0; list && k < RUN_COUNT(run); k++) {
        PyObject *v = PyLong_FromLongLong(e[RUN_OFFSET(run) + k].i);
        if (v == NULL) Py_CLEAR(list);
        else PyList_SET_ITEM(list, k, v);
    }
    return list;
}

PyObject *entry_tuple(const Cell *e) {
    int tag = HEADER_TAG(e[0].i);
    if (tag == TAG_TUPLE) return Py_NewRef(e[1].o);
    const char *cells = CELLS[tag];
    Py_ssize_t n = (Py_ssize_t)strlen(cells);
    PyObject *record = PyTuple_New(n);
    for (Py_ssize_t i = 0; record && i < n; i++) {
        PyObject *v;
        switch (cells[i]) {
        case 'h': v = PyLong_FromLong(tag); break;
        case 'i': v = PyLong_FromLongLong(e[i].i); break;
        case 'r': v = run_list(e, e[i].i); break;
        default: v = Py_NewRef(e[i].o ? e[i].o : Py_None);
        }
        if (v == NULL) Py_CLEAR(record);
        else PyTuple_SET_ITEM(record, i, v);
    }
    return record;
}

/* -- the output buffer -------------------------------------------------------------------- */

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

/* ``len`` (at most PAD) bytes of ``padded``, which has PAD readable: all PAD copied. */
static inline int put_padded(Buffer *b, const char *padded, Py_ssize_t len) {
    if (!reserve(b, PAD)) return 0;
    memcpy(b->data + b->len, padded, PAD);
    b->len += len;
    return 1;
}

/* A text kept beside its PAD copy: the copy written when the text fits in it. */
static inline int put_text_of(Buffer *b, const char *text, const char *padded, Py_ssize_t len) {
    return len <= PAD ? put_padded(b, padded, len) : put(b, text, len);
}

/* ``text`` in ``pad`` (PAD bytes), zero-filled, when it fits. */
static void pad_text(char *pad, const char *text, Py_ssize_t len) {
    memset(pad, 0, PAD);
    if (len <= PAD) memcpy(pad, text, (size_t)len);
}

/* "00".."99": ints are written two digits at a time, from the end. */
static const char PAIRS[] =
    "0001020304050607080910111213141516171819202122232425262728293031323334353637383940414243"
    "4445464748495051525354555657585960616263646566676869707172737475767778798081828384858687"
    "888990919293949596979899";

/* ``v`` in decimal ending just before ``end``: where it starts. */
static char *decimal(char *end, uint64_t v) {
    while (v >= 100) {
        end -= 2;
        memcpy(end, PAIRS + 2 * (v % 100), 2);
        v /= 100;
    }
    if (v < 10) {
        *--end = (char)('0' + v);
    } else {
        end -= 2;
        memcpy(end, PAIRS + 2 * v, 2);
    }
    return end;
}

static int put_int(Buffer *b, int64_t value) {
    char digits[2 * PAD], *end = digits + PAD; /* at most 20 digits and a sign before end */
    char *start = decimal(end, value < 0 ? (uint64_t)0 - (uint64_t)value : (uint64_t)value);
    if (value < 0) *--start = '-';
    return put_padded(b, start, end - start);
}

/* A time in ns since the epoch: its seconds' digits are the last line's but once a second,
 * so they are kept, and only the nine digits of the nanoseconds are made. */
static int put_time(Lines *l, Buffer *b, int64_t value) {
    if (value < 1000000000) return put_int(b, value);
    int64_t second = value / 1000000000, ns = value % 1000000000;
    if (second != l->second) {
        char *end = l->second_text + sizeof l->second_text;
        char *start = decimal(end, (uint64_t)second);
        l->second_len = (int)(end - start);
        memmove(l->second_text, start, (size_t)l->second_len);
        l->second = second;
    }
    if (!reserve(b, PAD + 9)) return 0;
    char *out = b->data + b->len;
    memcpy(out, l->second_text, PAD); /* its first second_len bytes: the digits */
    out += l->second_len + 9;
    for (int k = 0; k < 4; k++) {
        out -= 2;
        memcpy(out, PAIRS + 2 * (ns % 100), 2);
        ns /= 100;
    }
    out[-1] = (char)('0' + ns);
    b->len += l->second_len + 9;
    return 1;
}

/* Bytes from a mapping or callable, appended: 1, 0 not bytes, -1 error. */
static int put_bytes(Buffer *b, PyObject *found) {
    if (!PyBytes_CheckExact(found)) return 0;
    return put(b, PyBytes_AS_STRING(found), PyBytes_GET_SIZE(found)) ? 1 : -1;
}

COLD int long_as_int64(PyObject *value, int64_t *out) {
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

/* -- values ------------------------------------------------------------------------------- */

/* The slot for ``key``'s cached bytes. The cache is keyed by the object's address and keeps
 * the object alive, so an address is never another object's. Addresses hashed by a
 * multiplication: their low bits repeat from one 4 KiB pool of the allocator to the next, so
 * a plan's steps taken modulo the slots (as before) met each other's slots every flush. */
static Cached *cache_slot(Lines *l, PyObject *key) {
    return &l->cache[((uintptr_t)key * UINT64_C(0x9E3779B97F4A7C15)) >> (64 - CACHE_BITS)];
}

static void cache_put(Lines *l, PyObject *key, int kind, PyObject *bytes) {
    Cached *slot = cache_slot(l, key);
    Py_XSETREF(slot->key, Py_NewRef(key));
    Py_XSETREF(slot->bytes, Py_NewRef(bytes));
    slot->kind = kind;
    slot->len = PyBytes_GET_SIZE(bytes);
    pad_text(slot->pad, PyBytes_AS_STRING(bytes), slot->len);
}

/* The bytes the literals mapping gives for ``key`` (a dict subclass: __missing__ may run). */
static int put_mapped(Lines *l, Buffer *b, PyObject *key, PyObject *cache_key, int kind) {
    PyObject *found = PyDict_GetItemWithError(l->literals, key); /* borrowed */
    PyObject *owned = NULL;
    if (found == NULL) {
        if (PyErr_Occurred()) return -1;
        found = owned = PyObject_GetItem(l->literals, key);
        if (found == NULL) return -1;
    }
    int ok = put_bytes(b, found);
    if (ok == 1 && cache_key != NULL) cache_put(l, cache_key, kind, found);
    Py_XDECREF(owned);
    return ok;
}

static int put_text(Lines *l, Buffer *b, PyObject *step) {
    PyObject *key = PyLong_FromVoidPtr(step);
    if (key == NULL) return -1;
    PyObject *found = PyDict_GetItemWithError(l->texts, key); /* borrowed */
    Py_DECREF(key);
    PyObject *owned = NULL;
    if (found == NULL) {
        if (PyErr_Occurred()) return -1;
        found = owned = PyObject_CallOneArg(l->text, step);
        if (found == NULL) return -1;
    }
    int ok = put_bytes(b, found);
    if (ok == 1) cache_put(l, step, K_TEXT, found);
    Py_XDECREF(owned);
    return ok;
}

static int put_list(Buffer *b, PyObject *value) {
    if (!PyList_CheckExact(value)) return 0;
    if (!put(b, "[", 1)) return -1;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(value); i++) {
        int64_t v;
        if (!as_int64(PyList_GET_ITEM(value, i), &v)) return 0;
        if ((i && !put(b, ",", 1)) || !put_int(b, v)) return -1;
    }
    return put(b, "]", 1) ? 1 : -1;
}

static int put_run(Buffer *b, const Cell *e, int64_t run) {
    if (!put(b, "[", 1)) return -1;
    for (Py_ssize_t k = 0; k < RUN_COUNT(run); k++)
        if ((k && !put(b, ",", 1)) || !put_int(b, e[RUN_OFFSET(run) + k].i)) return -1;
    return put(b, "]", 1) ? 1 : -1;
}

static int put_shape(Lines *l, Buffer *b, PyObject *value) {
    if (PyTuple_CheckExact(value)) return put_mapped(l, b, value, value, K_SHAPE);
    if (!PyList_CheckExact(value) && !PyTuple_Check(value)) return 0; /* torch.Size: a tuple */
    PyObject *shape = PySequence_Tuple(value);
    if (shape == NULL) return -1;
    int ok = put_mapped(l, b, shape, NULL, K_SHAPE); /* a list may change: not cached */
    Py_DECREF(shape);
    return ok;
}

static int put_peer(Lines *l, Buffer *b, int64_t v) {
    if (l->peers == Py_None) return put_int(b, v) ? 1 : -1;
    if (l->peer_ids != NULL) {
        if (v < 0) v += l->npeers; /* as Python indexes */
        if (v < 0 || v >= l->npeers) return 0; /* the fallback raises the IndexError */
        return put_int(b, l->peer_ids[v]) ? 1 : -1;
    }
    PyObject *index = PyLong_FromLongLong(v);
    PyObject *peer = index ? PyObject_GetItem(l->peers, index) : NULL;
    Py_XDECREF(index);
    if (peer == NULL) {
        PyErr_Clear(); /* the fallback meets the same error and raises it */
        return 0;
    }
    int64_t id;
    int ok = as_int64(peer, &id);
    Py_DECREF(peer);
    return ok ? (put_int(b, id) ? 1 : -1) : 0;
}

static int put_int_kind(Lines *l, Buffer *b, int kind, int64_t v) {
    switch (kind) {
    case K_TIME:
        if (__builtin_add_overflow(v, l->offset, &v)) return 0;
        return put_time(l, b, v) ? 1 : -1;
    case K_PEER:
        return put_peer(l, b, v);
    default:
        return put_int(b, v) ? 1 : -1;
    }
}

static int put_object_kind(Lines *l, Buffer *b, int kind, PyObject *value) {
    if (kind == K_NONE) return value == Py_None;
    Cached *hit = cache_slot(l, value);
    if (hit->key == value && hit->kind == kind)
        return put_text_of(b, PyBytes_AS_STRING(hit->bytes), hit->pad, hit->len) ? 1 : -1;
    switch (kind) {
    case K_TEXT:
        return put_text(l, b, value);
    case K_LITERAL:
        return PyUnicode_CheckExact(value) ? put_mapped(l, b, value, value, K_LITERAL) : 0;
    case K_SHAPE:
        return put_shape(l, b, value);
    case K_INTS:
        return put_list(b, value);
    }
    return 0;
}

static int is_int_kind(int kind) { return kind == K_INT || kind == K_TIME || kind == K_PEER; }

/* One value: 1 written, 0 does not fit (the record goes to the fallback), -1 error. */
static int put_cell(Lines *l, Buffer *b, const Slot *s, const Cell *e) {
    Cell c = e[s->index];
    if (is_int_kind(s->kind)) return put_int_kind(l, b, s->kind, c.i);
    if (s->kind == K_INTS) return put_run(b, e, c.i);
    return put_object_kind(l, b, s->kind, c.o ? c.o : Py_None);
}

static int put_item(Lines *l, Buffer *b, const Slot *s, PyObject *record) {
    PyObject *value = PyTuple_GET_ITEM(record, s->index);
    int64_t v;
    if (is_int_kind(s->kind)) return as_int64(value, &v) ? put_int_kind(l, b, s->kind, v) : 0;
    return put_object_kind(l, b, s->kind, value);
}

/* A line by its layout, from cells (``record`` NULL) or a record tuple: 1 written, 0 does
 * not fit (nothing written), -1 error. */
static int put_layout(Lines *l, Buffer *b, const Layout *layout, const Cell *e, PyObject *record) {
    Py_ssize_t start = b->len;
    for (int i = 0; i < layout->nslots; i++) {
        const Slot *s = &layout->slots[i];
        if (!put_text_of(b, s->text, s->pad, s->text_len)) return -1;
        int ok = record ? put_item(l, b, s, record) : put_cell(l, b, s, e);
        if (ok != 1) {
            b->len = start;
            return ok;
        }
    }
    return put_text_of(b, layout->tail, layout->tail_pad, layout->tail_len) ? 1 : -1;
}

static int put_fallback(Lines *l, Buffer *b, PyObject *record) {
    PyObject *line = PyObject_CallOneArg(l->fallback, record);
    if (line == NULL) return -1;
    Py_buffer view;
    int ok = PyObject_GetBuffer(line, &view, PyBUF_SIMPLE) == 0;
    if (ok) {
        ok = put(b, view.buf, view.len);
        PyBuffer_Release(&view);
    }
    Py_DECREF(line);
    return ok ? 0 : -1;
}

/* A record tuple's layout, when it has one and the tuple's length. */
static const Layout *tuple_layout(Lines *l, PyObject *record) {
    int64_t tag;
    if (!PyTuple_CheckExact(record) || PyTuple_GET_SIZE(record) == 0) return NULL;
    if (!as_int64(PyTuple_GET_ITEM(record, 0), &tag) || tag < 0 || tag >= NTAGS) return NULL;
    const Layout *layout = &l->layouts[tag];
    return layout->known && PyTuple_GET_SIZE(record) == layout->length ? layout : NULL;
}

int lines_put(Lines *l, Buffer *b, const Cell *e) {
    int tag = HEADER_TAG(e[0].i), ok = 0;
    if (tag == TAG_TUPLE) {
        const Layout *layout = tuple_layout(l, e[1].o);
        ok = layout ? put_layout(l, b, layout, NULL, e[1].o) : 0;
        return ok < 0 ? -1 : ok ? 0 : put_fallback(l, b, e[1].o);
    }
    ok = l->layouts[tag].known ? put_layout(l, b, &l->layouts[tag], e, NULL) : 0;
    if (ok) return ok < 0 ? -1 : 0;
    PyObject *record = entry_tuple(e);
    if (record == NULL) return -1;
    ok = put_fallback(l, b, record);
    Py_DECREF(record);
    return ok;
}

/* -- opening: the layouts read and checked against CELLS ---------------------------------- */

/* Whether a slot's kind reads the cell the hot calls write at its index. */
static int kind_fits_cell(int kind, char cell) {
    if (is_int_kind(kind)) return cell == 'i';
    return kind == K_INTS ? cell == 'r' : cell == 'o';
}

static int read_layout(PyObject *entry, Layout *l, int tag) {
    PyObject *slots;
    if (!PyArg_ParseTuple(entry, "nO!y#", &l->length, &PyTuple_Type, &slots, &l->tail,
                          &l->tail_len))
        return 0;
    const char *cells = CELLS[tag];
    if (cells == NULL || (Py_ssize_t)strlen(cells) != l->length) {
        PyErr_Format(PyExc_ValueError, "layouts: record %d is not one the queue keeps", tag);
        return 0;
    }
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
        if (s->index < 1 || s->index >= l->length || s->kind < K_INT || s->kind > K_NONE ||
            !kind_fits_cell(s->kind, cells[s->index])) {
            PyErr_Format(PyExc_ValueError, "layouts: record %d's value %zd is not its cell",
                         tag, s->index);
            return 0;
        }
        pad_text(s->pad, s->text, s->text_len);
    }
    pad_text(l->tail_pad, l->tail, l->tail_len);
    l->known = 1;
    return 1;
}

/* The layouts: a tuple indexed by record tag, each None or
 * (length, ((text, index, kind), ...), tail). */
static int read_layouts(Lines *l, PyObject *spec) {
    if (!PyTuple_Check(spec) || PyTuple_GET_SIZE(spec) > NTAGS) {
        PyErr_SetString(PyExc_ValueError, "layouts: a tuple of at most one entry per tag");
        return 0;
    }
    for (int tag = 0; tag < PyTuple_GET_SIZE(spec); tag++) {
        PyObject *entry = PyTuple_GET_ITEM(spec, tag);
        if (entry != Py_None && !read_layout(entry, &l->layouts[tag], tag)) return 0;
    }
    return 1;
}

static int read_peers(Lines *l) {
    if (l->peers == Py_None || !PyTuple_CheckExact(l->peers)) return 1;
    Py_ssize_t n = PyTuple_GET_SIZE(l->peers);
    int64_t *ids = PyMem_Malloc((size_t)(n ? n : 1) * sizeof(int64_t));
    if (ids == NULL) {
        PyErr_NoMemory();
        return 0;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        if (!as_int64(PyTuple_GET_ITEM(l->peers, i), &ids[i])) {
            PyMem_Free(ids); /* written through Python's indexing instead */
            return 1;
        }
    }
    l->peer_ids = ids;
    l->npeers = n;
    return 1;
}

int lines_open(Lines *l, PyObject *spec, int64_t offset, PyObject *texts, PyObject *text,
               PyObject *literals, PyObject *peers, PyObject *fallback) {
    lines_clear(l);
    l->spec = Py_NewRef(spec);
    l->texts = Py_NewRef(texts);
    l->text = Py_NewRef(text);
    l->literals = Py_NewRef(literals);
    l->peers = Py_NewRef(peers);
    l->fallback = Py_NewRef(fallback);
    l->offset = offset;
    l->second = -1;
    if (!read_layouts(l, spec) || !read_peers(l)) {
        lines_clear(l);
        return -1;
    }
    return 0;
}

void lines_clear(Lines *l) {
    Py_CLEAR(l->spec);
    Py_CLEAR(l->texts);
    Py_CLEAR(l->text);
    Py_CLEAR(l->literals);
    Py_CLEAR(l->peers);
    Py_CLEAR(l->fallback);
    PyMem_Free(l->peer_ids);
    l->peer_ids = NULL;
    l->npeers = 0;
    for (int i = 0; i < CACHE_SLOTS; i++) {
        Py_CLEAR(l->cache[i].key);
        Py_CLEAR(l->cache[i].bytes);
    }
    memset(l->layouts, 0, sizeof l->layouts);
}

int lines_traverse(Lines *l, visitproc visit, void *arg) {
    Py_VISIT(l->spec);
    Py_VISIT(l->texts);
    Py_VISIT(l->text);
    Py_VISIT(l->literals);
    Py_VISIT(l->peers);
    Py_VISIT(l->fallback);
    for (int i = 0; i < CACHE_SLOTS; i++) {
        Py_VISIT(l->cache[i].key);
        Py_VISIT(l->cache[i].bytes);
    }
    return 0;
}
