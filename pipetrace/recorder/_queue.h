/* The recorder's event queue in C: what `_queue.c` (the queue and the hot calls) and
 * `_lines.c` (its entries written as event lines) share.
 *
 * An entry is a run of cells. Its first cell, the header, holds the record's tag (the tags
 * of pipetrace/recorder/encoding.py) and the entry's length in cells; the cells after it
 * are the record's values at the same indexes as in the record tuple the Python recorder
 * makes (cell 1 is the time, cell 2 the id, ...). `CELLS` says which cells of each tag hold
 * an int and which an object. A record the hot calls cannot keep in cells (an unusual
 * value, an optional field present) and every record appended from Python is kept as its
 * tuple, in an entry of tag TAG_TUPLE.
 */
#ifndef PIPETRACE_QUEUE_H
#define PIPETRACE_QUEUE_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

/* The hot calls run between chunks of a framework's work, which evicts their code from the
 * CPU's caches: each pays for the cache lines of code it runs. HOT functions are kept
 * together, each from a cache line's start (else where the linker happens to place them
 * moves a call's cost by a few lines), COLD ones (what the usual event never runs) out of
 * their way. */
#if defined(__GNUC__)
#define HOT __attribute__((hot, aligned(64)))
#define COLD __attribute__((cold, noinline))
#else
#define HOT
#define COLD
#endif

typedef union {
    int64_t i;
    PyObject *o; /* owned by the entry's holder; NULL is None */
} Cell;

enum { TAG_STEP_BEGIN, TAG_STEP_END, TAG_P2P_POST, TAG_P2P_DONE, TAG_OTHER, TAG_MEMORY, NTAGS };
#define TAG_TUPLE 255 /* cell 1: the record tuple itself */

#define HEADER(tag, length) ((int64_t)(tag) | ((int64_t)(length) << 8))
#define HEADER_TAG(h) ((int)((h)&0xff))
#define HEADER_LENGTH(h) ((Py_ssize_t)((h) >> 8))

/* A memory entry's lists are runs of ints after its 7 record cells; the record's cell holds
 * the run's (count << 32 | offset in the entry). */
#define RUN(offset, count) (((int64_t)(count) << 32) | (int64_t)(offset))
#define RUN_OFFSET(c) ((Py_ssize_t)((c)&0xffffffff))
#define RUN_COUNT(c) ((Py_ssize_t)((c) >> 32))

#define MAX_ENTRY 48 /* cells; a longer memory sample is kept as its tuple */

/* Per tag, what each cell holds: 'h' the header, 'i' an int, 'o' an object, 'r' a run of
 * ints; NULL: never kept in cells. */
extern const char *const CELLS[NTAGS];

/* Each cell's objects: the entry's references, taken or given back (`entries_init` first). */
void entries_init(void);
HOT void entry_incref(const Cell *e);
HOT void entry_decref(const Cell *e);
int entry_visit(const Cell *e, visitproc visit, void *arg);
/* The record tuple of an entry (a new reference). */
PyObject *entry_tuple(const Cell *e);

/* Writing lines: the encoder's description and caches, set when the queue is opened. */
#define MAX_SLOTS 24
/* Short texts are also kept in PAD bytes, zero-filled, and written by a copy of all PAD
 * bytes whose length the compiler knows (a few vector moves inline, not a call of memcpy
 * per piece of a line); the buffer's length then moves by the text's own. */
#define PAD 32
typedef struct {
    const char *text; /* written before the value */
    Py_ssize_t text_len;
    Py_ssize_t index; /* in the record */
    int kind;
    char pad[PAD]; /* the text, when it fits */
} Slot;

typedef struct {
    int known;
    Py_ssize_t length; /* of the record tuple */
    Slot slots[MAX_SLOTS];
    int nslots;
    const char *tail; /* after the last value, newline included */
    Py_ssize_t tail_len;
    char tail_pad[PAD];
} Layout;

#define CACHE_BITS 8
#define CACHE_SLOTS (1 << CACHE_BITS)
typedef struct {
    PyObject *key; /* a step, str or tuple, kept alive so that its address stays its own */
    PyObject *bytes;
    int kind;
    Py_ssize_t len; /* of bytes: when at most PAD, they are in pad too */
    char pad[PAD];
} Cached;

typedef struct {
    int64_t offset;
    PyObject *spec; /* the layouts' description: the slots' texts point into its bytes */
    Layout layouts[NTAGS];
    PyObject *texts, *text, *literals, *peers, *fallback;
    int64_t *peer_ids; /* peers as int64 when each is one, else NULL */
    Py_ssize_t npeers;
    Cached cache[CACHE_SLOTS];
    int64_t second; /* the last time's seconds (-1: none yet), and their digits */
    char second_text[PAD];
    int second_len;
} Lines;

typedef struct {
    char *data;
    Py_ssize_t len, cap;
} Buffer;

int lines_open(Lines *l, PyObject *spec, int64_t offset, PyObject *texts, PyObject *text,
               PyObject *literals, PyObject *peers, PyObject *fallback);
void lines_clear(Lines *l);
int lines_traverse(Lines *l, visitproc visit, void *arg);
/* An entry's line appended to ``b``: 0, or -1 with an exception set. */
int lines_put(Lines *l, Buffer *b, const Cell *e);
/* An exact int within int64: 1 (``out`` set) or 0. Inline for the ints that fit a machine
 * word's part of the int object (every count, size and time the hot calls see), so that the
 * usual call runs no code of the interpreter's (each function's code is one more cache line
 * that a framework's work evicted); `long_as_int64` for the rest. */
int long_as_int64(PyObject *value, int64_t *out);
static inline int as_int64(PyObject *value, int64_t *out) {
    if (!PyLong_CheckExact(value)) return 0;
#if PY_VERSION_HEX >= 0x030C0000
    if (PyUnstable_Long_IsCompact((PyLongObject *)value)) {
        *out = (int64_t)PyUnstable_Long_CompactValue((PyLongObject *)value);
        return 1;
    }
#else
    Py_ssize_t size = Py_SIZE(value);
    if (size >= -1 && size <= 1) { /* one digit (zero too: its digit is there, and 0) */
        *out = (int64_t)size * (int64_t)((PyLongObject *)value)->ob_digit[0];
        return 1;
    }
#endif
    return long_as_int64(value, out);
}

#endif
