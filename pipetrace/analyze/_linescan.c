/* Reading the event lines that the recorder writes from its templates, without decoding JSON.
 *
 * Nearly every line of a rank log is one of a few event types written from a byte template
 * (`pipetrace.recorder.format.line_template`): a fixed text with integer, string or
 * integer-list values in fixed places. `scan` matches each line of a chunk against those
 * templates (described by the caller, derived from the format's declarations) and writes
 * the values of a matching line into its group's row; a line that matches none (another
 * event type, another key order, whitespace, escapes, a number JSON would read as a float,
 * anything unusual) is listed for the caller to decode with a JSON parser. A line that
 * matches is therefore exactly the JSON object its template describes: the caller gets the
 * values a JSON decoder would have given, at a fraction of the cost.
 *
 * `codes` turns the (offset, length) of string values into the caller's interned codes:
 * a value met earlier in the same call is found in a small table of its bytes, another
 * through the caller's dict of raw bytes, and a value never seen goes to a Python callback.
 *
 * `simple_steps` reads step texts of the common "{stage}{KIND}{micro-batch}" form ("2F0",
 * "1SEND_B3") into their parts, and leaves every other text to the caller
 * (`pipetrace.analyze.model.parse_texts`).
 *
 * The Python side is `pipetrace/analyze/templated.py`.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

enum { V_INT = 0, V_STR = 1, V_INTS = 2 };
#define MAX_PARTS 32
#define MAX_TEMPLATES 16
#define MAX_DIGITS 19

typedef struct {
    const char *literal; /* the text before the value */
    Py_ssize_t literal_len;
    int kind;
} Part;

typedef struct {
    Part parts[MAX_PARTS];
    int nparts;
    const char *tail; /* the text after the last value, to the end of the line */
    Py_ssize_t tail_len;
    int group;
} Template;

/* A JSON integer: optional minus, no leading zero, at most 19 digits, within int64. */
static int parse_int(const char **at, const char *end, int64_t *out) {
    const char *p = *at;
    int negative = 0;
    if (p < end && *p == '-') {
        negative = 1;
        p++;
    }
    const char *digits = p;
    uint64_t value = 0;
    while (p < end && *p >= '0' && *p <= '9') {
        if (p - digits == MAX_DIGITS) return 0;
        value = value * 10 + (uint64_t)(*p - '0');
        p++;
    }
    Py_ssize_t count = p - digits;
    if (count == 0 || (count > 1 && *digits == '0') || value > (uint64_t)INT64_MAX) return 0;
    *out = negative ? -(int64_t)value : (int64_t)value;
    *at = p;
    return 1;
}

/* A JSON string of printable ASCII without escapes: its content's offset and length. */
static int parse_str(const char **at, const char *end, const char *base, int64_t *out) {
    const char *p = *at;
    if (p >= end || *p != '"') return 0;
    const char *q = ++p;
    while (q < end && *q >= 0x20 && *q < 0x7f && *q != '"' && *q != '\\') q++;
    if (q >= end || *q != '"') return 0;
    out[0] = p - base;
    out[1] = q - p;
    *at = q + 1;
    return 1;
}

/* A JSON list of integers without spaces: the offset and length of its whole text. */
static int parse_ints(const char **at, const char *end, const char *base, int64_t *out) {
    const char *p = *at;
    int64_t ignored;
    if (p >= end || *p != '[') return 0;
    const char *q = p + 1;
    if (q < end && *q == ']') {
        q++;
    } else {
        for (;;) {
            if (!parse_int(&q, end, &ignored)) return 0;
            if (q < end && *q == ',') {
                q++;
                continue;
            }
            if (q < end && *q == ']') {
                q++;
                break;
            }
            return 0;
        }
    }
    out[0] = p - base;
    out[1] = q - p;
    *at = q;
    return 1;
}

/* Does [s, e) match the template? Its values go to row (strings: offset and length). */
static int match(const Template *t, const char *s, const char *e, const char *base, int64_t *row) {
    const char *p = s;
    int column = 0;
    for (int i = 0; i < t->nparts; i++) {
        const Part *part = &t->parts[i];
        if (e - p < part->literal_len || memcmp(p, part->literal, part->literal_len) != 0)
            return 0;
        p += part->literal_len;
        if (part->kind == V_INT) {
            if (!parse_int(&p, e, row + column)) return 0;
            column += 1;
        } else if (part->kind == V_STR) {
            if (!parse_str(&p, e, base, row + column)) return 0;
            column += 2;
        } else {
            if (!parse_ints(&p, e, base, row + column)) return 0;
            column += 2;
        }
    }
    return e - p == t->tail_len && memcmp(p, t->tail, t->tail_len) == 0;
}

static int read_templates(PyObject *list, Template *out, int *count) {
    /* list of (group, ((literal, kind), ...), tail); the bytes stay owned by the list */
    if (!PyList_Check(list) || PyList_GET_SIZE(list) > MAX_TEMPLATES) {
        PyErr_SetString(PyExc_ValueError, "templates: a list of at most 16 templates");
        return 0;
    }
    *count = (int)PyList_GET_SIZE(list);
    for (int i = 0; i < *count; i++) {
        PyObject *item = PyList_GET_ITEM(list, i), *parts;
        Template *t = &out[i];
        if (!PyArg_ParseTuple(item, "iO!y#", &t->group, &PyTuple_Type, &parts, &t->tail,
                              &t->tail_len))
            return 0;
        if (PyTuple_GET_SIZE(parts) > MAX_PARTS || PyTuple_GET_SIZE(parts) < 1) {
            PyErr_SetString(PyExc_ValueError, "templates: 1 to 32 parts each");
            return 0;
        }
        t->nparts = (int)PyTuple_GET_SIZE(parts);
        for (int j = 0; j < t->nparts; j++) {
            Part *part = &t->parts[j];
            if (!PyArg_ParseTuple(PyTuple_GET_ITEM(parts, j), "y#i", &part->literal,
                                  &part->literal_len, &part->kind))
                return 0;
        }
        if (t->parts[0].kind != V_INT) {
            PyErr_SetString(PyExc_ValueError, "templates: the first value is the time");
            return 0;
        }
    }
    return 1;
}

/* A 2-d C-contiguous array of int64 (the caller's numpy array), or an error. */
static int matrix(PyObject *object, Py_buffer *view, int writable) {
    int flags = PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0);
    if (PyObject_GetBuffer(object, view, flags) < 0) return 0;
    if (view->ndim != 2 || view->itemsize != 8 || strchr("qlLQ", view->format[0]) == NULL) {
        PyBuffer_Release(view);
        PyErr_SetString(PyExc_ValueError, "expected a 2-d C-contiguous int64 array");
        return 0;
    }
    return 1;
}

PyDoc_STRVAR(scan_doc,
             "scan(chunk, templates, groups, counts, times, other) -> number of other lines\n\n"
             "Match each line of chunk (lines split by \\n, no final newline) against the\n"
             "templates, in order. A matching line's values fill the next row of its group\n"
             "(groups[g]: a C-contiguous int64 array of shape (lines, width)); counts[g] is\n"
             "its row count, times[line] its first value. Each other line fills a row of\n"
             "other (shape (lines, 3)): its index, start and end offsets.");

static PyObject *scan(PyObject *self, PyObject *args) {
    Py_buffer chunk = {0}, counts = {0}, times = {0}, other = {0};
    Py_buffer groups[MAX_TEMPLATES];
    Py_ssize_t widths[MAX_TEMPLATES];
    int ngroups = 0, ntemplates = 0;
    Template templates[MAX_TEMPLATES];
    PyObject *template_list, *group_list, *result = NULL;

    if (!PyArg_ParseTuple(args, "y*O!O!w*w*w*", &chunk, &PyList_Type, &template_list,
                          &PyList_Type, &group_list, &counts, &times, &other))
        return NULL;
    if (!read_templates(template_list, templates, &ntemplates)) goto done;
    if (counts.len % 8 || times.len % 8 || other.len % 8) {
        PyErr_SetString(PyExc_ValueError, "counts, times, other: int64 buffers");
        goto done;
    }
    if (PyList_GET_SIZE(group_list) > MAX_TEMPLATES) {
        PyErr_SetString(PyExc_ValueError, "groups: at most 16");
        goto done;
    }
    for (; ngroups < PyList_GET_SIZE(group_list); ngroups++) {
        Py_buffer *g = &groups[ngroups];
        if (!matrix(PyList_GET_ITEM(group_list, ngroups), g, 1)) goto done;
        widths[ngroups] = g->shape[1];
    }
    Py_ssize_t capacity = times.len / 8;
    if (counts.len / 8 < ngroups || other.len / 8 < 3 * capacity) {
        PyErr_SetString(PyExc_ValueError, "counts or other too small");
        goto done;
    }
    for (int i = 0; i < ntemplates; i++) {
        int g = templates[i].group;
        Py_ssize_t needed = 0;
        for (int j = 0; j < templates[i].nparts; j++)
            needed += templates[i].parts[j].kind == V_INT ? 1 : 2;
        if (g < 0 || g >= ngroups || needed > widths[g] || groups[g].len / 8 / widths[g] < capacity) {
            PyErr_SetString(PyExc_ValueError, "a template's group is missing or too small");
            goto done;
        }
    }

    int64_t *count = counts.buf, *time = times.buf, *others = other.buf;
    Py_ssize_t nother = 0, line = 0;
    memset(count, 0, sizeof(int64_t) * ngroups);
    const char *base = chunk.buf, *end = base + chunk.len, *s = base;
    while (s <= end) {
        const char *e = memchr(s, '\n', end - s);
        if (e == NULL) e = end;
        if (line == capacity) {
            PyErr_SetString(PyExc_ValueError, "more lines than the buffers hold");
            goto done;
        }
        int matched = 0;
        for (int i = 0; i < ntemplates && !matched; i++) {
            int g = templates[i].group;
            int64_t *row = (int64_t *)groups[g].buf + count[g] * widths[g];
            if (match(&templates[i], s, e, base, row)) {
                time[line] = row[0];
                count[g]++;
                matched = 1;
            }
        }
        if (!matched) {
            others[3 * nother] = line;
            others[3 * nother + 1] = s - base;
            others[3 * nother + 2] = e - base;
            nother++;
        }
        line++;
        s = e + 1;
    }
    result = Py_BuildValue("(nn)", line, nother);
done:
    for (int i = 0; i < ngroups; i++) PyBuffer_Release(&groups[i]);
    PyBuffer_Release(&chunk);
    PyBuffer_Release(&counts);
    PyBuffer_Release(&times);
    PyBuffer_Release(&other);
    return result;
}

PyDoc_STRVAR(codes_doc,
             "codes(chunk, rows, column, known, on_miss, out) -> bool\n\n"
             "For each row of rows (a 2-d int64 array), the code of the bytes\n"
             "chunk[row[column] : row[column] + row[column + 1]]: the code of an earlier\n"
             "row with the same bytes, else known[bytes] if there, else on_miss(bytes),\n"
             "which is then kept in known. Codes go to out (int32).\n"
             "False (and out incomplete) as soon as a code is negative: the caller's sign\n"
             "that the value cannot be used.");

/* The values met in one `codes` call, by their bytes: most rows repeat a value an earlier
 * row of the chunk had, and finding it here costs no Python object. */
#define SEEN_SLOTS 4096 /* a power of two */
typedef struct {
    const char *text;
    int64_t length;
    int32_t code;
} Seen;

static uint64_t hash_bytes(const char *text, int64_t length) {
    uint64_t h = 1469598103934665603ULL; /* FNV-1a */
    for (int64_t i = 0; i < length; i++) h = (h ^ (unsigned char)text[i]) * 1099511628211ULL;
    return h;
}

/* The code of a value through the caller's dict (then its callback); -1: an error is set,
 * -2: the callback refused the value. */
static long code_of(const char *text, int64_t length, PyObject *known, PyObject *on_miss) {
    PyObject *key = PyBytes_FromStringAndSize(text, length);
    if (key == NULL) return -1;
    PyObject *value = PyDict_GetItemWithError(known, key); /* borrowed */
    if (value == NULL) {
        if (PyErr_Occurred()) {
            Py_DECREF(key);
            return -1;
        }
        value = PyObject_CallOneArg(on_miss, key);
        if (value == NULL || PyDict_SetItem(known, key, value) < 0) {
            Py_XDECREF(value);
            Py_DECREF(key);
            return -1;
        }
        Py_DECREF(value); /* known holds it */
    }
    Py_DECREF(key);
    long code = PyLong_AsLong(value);
    if (code == -1 && PyErr_Occurred()) return -1;
    if (code < 0) return -2;
    if (code > INT32_MAX) {
        PyErr_SetString(PyExc_OverflowError, "codes: a code beyond int32");
        return -1;
    }
    return code;
}

static PyObject *codes(PyObject *self, PyObject *args) {
    Py_buffer chunk = {0}, rows = {0}, out = {0};
    Py_ssize_t column;
    PyObject *rows_object, *known, *on_miss, *result = NULL;
    Seen *seen = NULL;
    if (!PyArg_ParseTuple(args, "y*OnO!Ow*", &chunk, &rows_object, &column, &PyDict_Type,
                          &known, &on_miss, &out))
        return NULL;
    if (!matrix(rows_object, &rows, 0)) {
        PyBuffer_Release(&chunk);
        PyBuffer_Release(&out);
        return NULL;
    }
    if (column < 0 || column + 1 >= rows.shape[1] || out.len / 4 < rows.shape[0]) {
        PyErr_SetString(PyExc_ValueError, "codes: rows (n, width) int64, out int32 of n");
        goto done;
    }
    seen = PyMem_Calloc(SEEN_SLOTS, sizeof(Seen));
    if (seen == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    Py_ssize_t n = rows.shape[0], width = rows.shape[1], filled = 0;
    const int64_t *row = rows.buf;
    int32_t *code_out = out.buf;
    const char *base = chunk.buf;
    for (Py_ssize_t i = 0; i < n; i++, row += width) {
        int64_t offset = row[column], length = row[column + 1];
        if (offset < 0 || length < 0 || offset + length > chunk.len) {
            PyErr_SetString(PyExc_ValueError, "codes: a value outside the chunk");
            goto done;
        }
        const char *text = base + offset;
        uint64_t slot = hash_bytes(text, length) & (SEEN_SLOTS - 1);
        while (seen[slot].text != NULL &&
               (seen[slot].length != length || memcmp(seen[slot].text, text, length) != 0))
            slot = (slot + 1) & (SEEN_SLOTS - 1);
        if (seen[slot].text != NULL) {
            code_out[i] = seen[slot].code;
            continue;
        }
        long code = code_of(text, length, known, on_miss);
        if (code == -1) goto done;
        if (code == -2) {
            result = Py_NewRef(Py_False);
            goto done;
        }
        code_out[i] = (int32_t)code;
        if (filled < SEEN_SLOTS / 2) { /* past half full, the rest go through the dict */
            seen[slot] = (Seen){text, length, (int32_t)code};
            filled++;
        }
    }
    result = Py_NewRef(Py_True);
done:
    PyMem_Free(seen);
    PyBuffer_Release(&chunk);
    PyBuffer_Release(&rows);
    PyBuffer_Release(&out);
    return result;
}

PyDoc_STRVAR(simple_steps_doc,
             "simple_steps(texts, kinds, kind, stage, microbatch) -> list\n\n"
             "For each text of the list texts written \"{stage}{KIND}{micro-batch}\" (ASCII\n"
             "digits, at most 9 each, and a key of the dict kinds between them), its kind\n"
             "code (kinds[KIND]), stage and micro-batch, written at its index into kind\n"
             "(int8), stage and microbatch (int32). Returns the indexes of the other texts,\n"
             "for the caller to parse as it would parse any text.");

/* A run of ASCII digits from text[*at]: its value, or -1 when there is none or it has more
 * than 9 digits (the caller's general path reads those). */
static long digit_run(const Py_UCS1 *text, Py_ssize_t *at, Py_ssize_t end, int from_end) {
    Py_ssize_t first = *at, last = *at;
    if (from_end) {
        while (first > 0 && text[first - 1] >= '0' && text[first - 1] <= '9') first--;
        *at = first;
    } else {
        while (last < end && text[last] >= '0' && text[last] <= '9') last++;
        *at = last;
    }
    if (last == first || last - first > 9) return -1;
    long value = 0;
    for (Py_ssize_t i = first; i < last; i++) value = value * 10 + (text[i] - '0');
    return value;
}

/* The kind code of one text (-1: not of the simple form), its stage and micro-batch. */
static int simple_step(PyObject *text, PyObject *kinds, long *stage, long *micro) {
    if (!PyUnicode_CheckExact(text) || !PyUnicode_IS_ASCII(text)) return -1;
    const Py_UCS1 *data = PyUnicode_1BYTE_DATA(text);
    Py_ssize_t length = PyUnicode_GET_LENGTH(text), head = 0, tail = length;
    *stage = digit_run(data, &head, length, 0);
    *micro = digit_run(data, &tail, length, 1);
    if (*stage < 0 || *micro < 0 || tail <= head) return -1;
    PyObject *name = PyUnicode_FromStringAndSize((const char *)data + head, tail - head);
    if (name == NULL) return -2;
    PyObject *code = PyDict_GetItemWithError(kinds, name); /* borrowed */
    Py_DECREF(name);
    if (code == NULL) return PyErr_Occurred() ? -2 : -1;
    long value = PyLong_AsLong(code);
    if (value == -1 && PyErr_Occurred()) return -2;
    return value >= 0 && value <= INT8_MAX ? (int)value : -1;
}

static PyObject *simple_steps(PyObject *self, PyObject *args) {
    PyObject *texts, *kinds, *left = NULL;
    Py_buffer kind = {0}, stage = {0}, micro = {0};
    if (!PyArg_ParseTuple(args, "O!O!w*w*w*", &PyList_Type, &texts, &PyDict_Type, &kinds,
                          &kind, &stage, &micro))
        return NULL;
    Py_ssize_t n = PyList_GET_SIZE(texts);
    if (kind.len < n || stage.len / 4 < n || micro.len / 4 < n) {
        PyErr_SetString(PyExc_ValueError, "simple_steps: outputs shorter than the texts");
        goto done;
    }
    left = PyList_New(0);
    if (left == NULL) goto done;
    for (Py_ssize_t i = 0; i < n; i++) {
        long st, mb;
        int code = simple_step(PyList_GET_ITEM(texts, i), kinds, &st, &mb);
        if (code == -2) {
            Py_CLEAR(left);
            goto done;
        }
        if (code >= 0) {
            ((int8_t *)kind.buf)[i] = (int8_t)code;
            ((int32_t *)stage.buf)[i] = (int32_t)st;
            ((int32_t *)micro.buf)[i] = (int32_t)mb;
            continue;
        }
        PyObject *index = PyLong_FromSsize_t(i);
        if (index == NULL || PyList_Append(left, index) < 0) {
            Py_XDECREF(index);
            Py_CLEAR(left);
            goto done;
        }
        Py_DECREF(index);
    }
done:
    PyBuffer_Release(&kind);
    PyBuffer_Release(&stage);
    PyBuffer_Release(&micro);
    return left;
}

static PyMethodDef methods[] = {
    {"scan", scan, METH_VARARGS, scan_doc},
    {"codes", codes, METH_VARARGS, codes_doc},
    {"simple_steps", simple_steps, METH_VARARGS, simple_steps_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_linescan",
    "Template matching of recorder-written event lines (see templated.py).", -1, methods,
};

PyMODINIT_FUNC PyInit__linescan(void) { return PyModule_Create(&module); }
