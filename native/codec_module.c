/* Python bindings of the codec (memsnap._codec): buffers in, GIL released, typed errors out. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <string.h>

#include "gf256.h"
#include "rs.h"

static PyObject *CodecError, *ShardSizeError;

/* "data shard 3" / "parity shard 5" for entry idx of a list whose stripe positions are ids. */
static PyObject *shard_name(PyObject *ids, Py_ssize_t idx, int k, const char *fallback)
{
    if (ids == Py_None)
        return PyUnicode_FromFormat("%s %zd", fallback, idx);
    PyObject *item = PySequence_GetItem(ids, idx);
    long id = item ? PyLong_AsLong(item) : -1;
    Py_XDECREF(item);
    PyErr_Clear();
    return PyUnicode_FromFormat("%s shard %ld", id < k ? "data" : "parity", id);
}

typedef struct {
    Py_buffer *bufs;
    Py_ssize_t count;
} buffer_set;

static void release_all(buffer_set *set)
{
    for (Py_ssize_t i = 0; i < set->count; i++)
        PyBuffer_Release(&set->bufs[i]);
    PyMem_Free(set->bufs);
    set->bufs = NULL;
    set->count = 0;
}

static void raise_buffer_error(PyObject *name, PyObject *obj, int writable)
{
    PyObject *why = NULL, *type = NULL, *tb = NULL;
    PyErr_Fetch(&type, &why, &tb);
    PyErr_Format(CodecError,
                 writable ? "%U: %s is not a writable contiguous buffer (%S); pass a bytearray, a "
                            "writable memoryview or a C-contiguous numpy uint8 array"
                          : "%U: %s is not a contiguous buffer (%S); pass bytes, a memoryview, a "
                            "C-contiguous numpy uint8 array or a pyarrow Buffer (torch: t.numpy())",
                 name, Py_TYPE(obj)->tp_name, why ? why : Py_None);
    Py_XDECREF(type);
    Py_XDECREF(why);
    Py_XDECREF(tb);
}

/* Acquires every buffer of seq; all must hold `*len` bytes (set from the first when < 0). */
static int acquire(PyObject *seq, buffer_set *set, int writable, PyObject *ids, int k,
                   const char *fallback, Py_ssize_t *len, PyObject **first)
{
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    set->bufs = PyMem_Calloc(n ? n : 1, sizeof(Py_buffer));
    if (!set->bufs) {
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *obj = PySequence_Fast_GET_ITEM(seq, i);
        if (PyObject_GetBuffer(obj, &set->bufs[i], writable ? PyBUF_WRITABLE : PyBUF_SIMPLE) < 0) {
            PyObject *name = shard_name(ids, i, k, fallback);
            raise_buffer_error(name, obj, writable);
            Py_XDECREF(name);
            return -1;
        }
        set->count = i + 1;
        if (*len < 0) {
            *len = set->bufs[i].len;
            *first = shard_name(ids, i, k, fallback);
        } else if (set->bufs[i].len != *len) {
            PyObject *name = shard_name(ids, i, k, fallback);
            PyErr_Format(ShardSizeError,
                         "%U has %zd bytes, expected %zd like %U: all shards of a stripe must "
                         "have the same length",
                         name, set->bufs[i].len, *len, *first);
            Py_XDECREF(name);
            return -1;
        }
    }
    return 0;
}

/* Re-lays a decode of data shards a < b of a RAID-6 (m == 2) stripe for the syndrome kernel:
 * the inputs are the k - 2 surviving data shards in order, then P and Q. */
static void pqd_layout(rs_job *job, uint8_t **ptrs, const buffer_set *in, int a, int b)
{
    int k = job->cols, next = 0;
    uint8_t **data = ptrs + k + 2; /* after the inputs (k) and the outputs (2) */
    for (int i = 0; i < k; i++)
        data[i] = (i == a || i == b) ? NULL : in->bufs[next++].buf;
    data[k] = in->bufs[k - 2].buf;
    data[k + 1] = in->bufs[k - 1].buf;
    job->in = (const uint8_t *const *)data;
    job->pqd = 1;
    uint8_t c[2];
    c[0] = gf_inv(gf_pow2(a) ^ gf_pow2(b));
    c[1] = gf_mul(gf_pow2(b), c[0]);
    gf_tables(c, 2, job->pqd_tables);
}

static PyObject *py_apply(PyObject *self, PyObject *args)
{
    Py_buffer coef, tables;
    int rows, cols, threads, k;
    int pqd_a = -1, pqd_b = -1;
    PyObject *inputs, *outputs, *in_ids, *out_ids;
    if (!PyArg_ParseTuple(args, "y*y*iiOOiOOi|ii", &coef, &tables, &rows, &cols, &inputs, &outputs,
                          &threads, &in_ids, &out_ids, &k, &pqd_a, &pqd_b))
        return NULL;
    PyObject *in_seq = NULL, *out_seq = NULL, *first = NULL, *result = NULL;
    buffer_set in_set = {0}, out_set = {0};
    uint8_t **ptrs = NULL;
    Py_ssize_t len = -1;
    if (rows < 0 || cols < 1 || coef.len != (Py_ssize_t)rows * cols ||
        tables.len != (Py_ssize_t)rows * cols * 32) {
        PyErr_SetString(CodecError, "internal: coefficient/table sizes do not match rows x cols");
        goto done;
    }
    in_seq = PySequence_Fast(inputs, "the data shards must be a list or tuple of buffers");
    out_seq = in_seq ? PySequence_Fast(outputs, "the outputs must be a list or tuple of buffers") : NULL;
    if (!out_seq)
        goto done;
    if (PySequence_Fast_GET_SIZE(in_seq) != cols || PySequence_Fast_GET_SIZE(out_seq) != rows) {
        PyErr_Format(CodecError, "expected %d input and %d output buffers, got %zd and %zd", cols,
                     rows, PySequence_Fast_GET_SIZE(in_seq), PySequence_Fast_GET_SIZE(out_seq));
        goto done;
    }
    if (acquire(in_seq, &in_set, 0, in_ids, k, "input", &len, &first) < 0 ||
        acquire(out_seq, &out_set, 1, out_ids, k, "output", &len, &first) < 0)
        goto done;
    ptrs = PyMem_Malloc(sizeof(uint8_t *) * (size_t)(rows + 2 * cols + 2)); /* + pqd_layout */
    if (!ptrs) {
        PyErr_NoMemory();
        goto done;
    }
    for (int i = 0; i < cols; i++)
        ptrs[i] = in_set.bufs[i].buf;
    for (int j = 0; j < rows; j++)
        ptrs[cols + j] = out_set.bufs[j].buf;
    rs_job job = {.rows = rows, .cols = cols, .coef = coef.buf, .tables = tables.buf,
                  .in = (const uint8_t *const *)ptrs, .out = ptrs + cols};
    rs_job_classify(&job);
    if (pqd_a >= 0 && pqd_b > pqd_a && pqd_b < cols && rows == 2 && rs_isa() == RS_ISA_AVX2)
        pqd_layout(&job, ptrs, &in_set, pqd_a, pqd_b);
    if (len > 0 && rows > 0) {
        Py_BEGIN_ALLOW_THREADS
        rs_run(&job, (size_t)len, threads);
        Py_END_ALLOW_THREADS
    }
    result = Py_NewRef(Py_None);
done:
    release_all(&in_set);
    release_all(&out_set);
    PyMem_Free(ptrs);
    Py_XDECREF(first);
    Py_XDECREF(in_seq);
    Py_XDECREF(out_seq);
    PyBuffer_Release(&coef);
    PyBuffer_Release(&tables);
    return result;
}

static PyObject *py_generator(PyObject *self, PyObject *args)
{
    int k, m;
    if (!PyArg_ParseTuple(args, "ii", &k, &m))
        return NULL;
    if (k < 1 || m < 0 || k + m > 256) {
        PyErr_Format(CodecError, "k=%d, m=%d out of range: need 1 <= k, 0 <= m, k + m <= 256", k, m);
        return NULL;
    }
    PyObject *out = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)k * m);
    if (out && m > 0)
        gf_generator(k, m, (uint8_t *)PyBytes_AS_STRING(out));
    return out;
}

static PyObject *py_tables(PyObject *self, PyObject *args)
{
    Py_buffer coef;
    if (!PyArg_ParseTuple(args, "y*", &coef))
        return NULL;
    PyObject *out = PyBytes_FromStringAndSize(NULL, coef.len * 32);
    if (out)
        gf_tables(coef.buf, (size_t)coef.len, (uint8_t *)PyBytes_AS_STRING(out));
    PyBuffer_Release(&coef);
    return out;
}

/* Rows `wanted` of full (n x k) expressed in terms of the k rows `used`: full[wanted] . full[used]^-1 */
static PyObject *py_decode_matrix(PyObject *self, PyObject *args)
{
    Py_buffer full;
    int k;
    PyObject *used, *wanted;
    if (!PyArg_ParseTuple(args, "y*iOO", &full, &k, &used, &wanted))
        return NULL;
    PyObject *out = NULL;
    Py_ssize_t nu = PySequence_Size(used), nw = PySequence_Size(wanted), n = full.len / (k ? k : 1);
    uint8_t *sub = NULL;
    if (nu != k || nw < 0 || k < 1) {
        PyErr_Format(CodecError, "internal: need exactly k=%d surviving rows", k);
        goto done;
    }
    sub = PyMem_Malloc((size_t)k * k);
    out = sub ? PyBytes_FromStringAndSize(NULL, nw * k) : PyErr_NoMemory();
    if (!out)
        goto done;
    for (int r = 0; r < k; r++) {
        PyObject *item = PySequence_GetItem(used, r);
        long row = item ? PyLong_AsLong(item) : -1;
        Py_XDECREF(item);
        if (row < 0 || row >= n)
            goto bad_row;
        memcpy(sub + (size_t)r * k, (uint8_t *)full.buf + row * k, (size_t)k);
    }
    if (gf_invert(sub, k) < 0) {
        PyErr_SetString(CodecError, "internal: the surviving rows are singular (generator not MDS)");
        goto fail;
    }
    uint8_t *dst = (uint8_t *)PyBytes_AS_STRING(out);
    for (Py_ssize_t w = 0; w < nw; w++) {
        PyObject *item = PySequence_GetItem(wanted, w);
        long row = item ? PyLong_AsLong(item) : -1;
        Py_XDECREF(item);
        if (row < 0 || row >= n)
            goto bad_row;
        const uint8_t *src = (uint8_t *)full.buf + row * k;
        for (int c = 0; c < k; c++) {
            uint8_t acc = 0;
            for (int x = 0; x < k; x++)
                acc ^= gf_mul(src[x], sub[x * k + c]);
            dst[w * k + c] = acc;
        }
    }
    goto done;
bad_row:
    if (!PyErr_Occurred())
        PyErr_SetString(CodecError, "internal: shard row index out of range");
fail:
    Py_CLEAR(out);
done:
    PyMem_Free(sub);
    PyBuffer_Release(&full);
    return out;
}

static PyObject *py_isa(PyObject *self, PyObject *noargs)
{
    return PyUnicode_FromString(rs_isa_names[rs_isa()]);
}

static PyObject *py_available_isas(PyObject *self, PyObject *noargs)
{
    PyObject *out = PyList_New(0);
    for (int i = 0; out && i < RS_ISA_COUNT; i++) {
        PyObject *name = rs_isa_available(i) ? PyUnicode_FromString(rs_isa_names[i]) : NULL;
        if (name && PyList_Append(out, name) < 0)
            Py_CLEAR(out);
        Py_XDECREF(name);
    }
    return out;
}

static PyObject *py_set_isa(PyObject *self, PyObject *arg)
{
    const char *name = PyUnicode_AsUTF8(arg);
    if (!name)
        return NULL;
    for (int i = 0; i < RS_ISA_COUNT; i++)
        if (strcmp(name, rs_isa_names[i]) == 0) {
            if (rs_set_isa(i) < 0)
                return PyErr_Format(CodecError, "ISA %R is not supported by this CPU or build", arg);
            Py_RETURN_NONE;
        }
    return PyErr_Format(CodecError, "unknown ISA %R: use one of scalar, ssse3, avx2", arg);
}

static PyMethodDef methods[] = {
    {"apply", py_apply, METH_VARARGS,
     "apply(coef, tables, rows, cols, inputs, outputs, threads, in_ids, out_ids, k)"},
    {"generator", py_generator, METH_VARARGS, "generator(k, m) -> m x k generator rows"},
    {"tables", py_tables, METH_VARARGS, "tables(coef) -> 32 bytes of nibble products each"},
    {"decode_matrix", py_decode_matrix, METH_VARARGS, "decode_matrix(full, k, used, wanted)"},
    {"isa", py_isa, METH_NOARGS, "the kernel level in use"},
    {"available_isas", py_available_isas, METH_NOARGS, "kernel levels this CPU runs"},
    {"set_isa", py_set_isa, METH_O, "choose the kernel level"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "memsnap._codec",
                                    "Native GF(2^8) Reed-Solomon kernels.", -1, methods,
                                    NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__codec(void)
{
    rs_init();
    PyObject *errors = PyImport_ImportModule("memsnap.errors");
    if (!errors)
        return NULL;
    CodecError = PyObject_GetAttrString(errors, "CodecError");
    ShardSizeError = PyObject_GetAttrString(errors, "ShardSizeError");
    Py_DECREF(errors);
    if (!CodecError || !ShardSizeError)
        return NULL;
    return PyModule_Create(&module);
}
