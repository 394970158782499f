/* kvfabric.core.cache._crc32c: CRC-32C (Castagnoli: iSCSI's, ext4's and RocksDB's) of a
 * buffer. The disk tier checks every page it reads back against the value it wrote; zlib's
 * CRC-32 runs at about 1.8 GB/s a core here, below the disk's plain read, while the
 * SSE4.2 instruction does 8 bytes a step, on three streams at once. Where the CPU lacks
 * it (or is not x86-64) a table walk 8 bytes at a time gives the same values.
 *
 * crc32c(data, crc=0, /) -> int: the CRC-32C of `data` (any C-contiguous buffer), or
 * of the bytes before it followed by `data` when `crc` is theirs (as zlib.crc32's
 * `value`). portable(data, crc=0, /) is the same without the instruction (for the
 * tests). HARDWARE says which one crc32c runs. The GIL is released over large buffers;
 * nothing is kept across calls. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <nmmintrin.h>
#define CRC_X86 1
#endif

#define CRC_POLY        0x82F63B78u /* Castagnoli, bit-reversed */
#define CRC_NOGIL_BYTES (16 << 10)  /* past this, others may run while we sum */

static uint32_t crc_table[8][256];
static int crc_hardware;

static void
crc_init_table(void)
{
    for (uint32_t i = 0; i < 256; i++) {
        uint32_t c = i;
        for (int k = 0; k < 8; k++) {
            c = (c >> 1) ^ (CRC_POLY & (0u - (c & 1u)));
        }
        crc_table[0][i] = c;
    }
    for (uint32_t i = 0; i < 256; i++) {
        for (int t = 1; t < 8; t++) {
            uint32_t c = crc_table[t - 1][i];
            crc_table[t][i] = (c >> 8) ^ crc_table[0][c & 0xFF];
        }
    }
}

static uint32_t
crc_portable(uint32_t crc, const unsigned char *p, size_t n)
{
    for (; n > 0 && ((uintptr_t)p & 7) != 0; n--) {
        crc = (crc >> 8) ^ crc_table[0][(crc ^ *p++) & 0xFF];
    }
    for (; n >= 8; n -= 8, p += 8) {
        uint32_t lo, hi;
        memcpy(&lo, p, 4);
        memcpy(&hi, p + 4, 4);
#if PY_BIG_ENDIAN
        lo = __builtin_bswap32(lo);
        hi = __builtin_bswap32(hi);
#endif
        lo ^= crc;
        crc = crc_table[7][lo & 0xFF] ^ crc_table[6][(lo >> 8) & 0xFF] ^
              crc_table[5][(lo >> 16) & 0xFF] ^ crc_table[4][lo >> 24] ^ crc_table[3][hi & 0xFF] ^
              crc_table[2][(hi >> 8) & 0xFF] ^ crc_table[1][(hi >> 16) & 0xFF] ^
              crc_table[0][hi >> 24];
    }
    for (; n > 0; n--) {
        crc = (crc >> 8) ^ crc_table[0][(crc ^ *p++) & 0xFF];
    }
    return crc;
}

/* Appending n zero bytes to a CRC register is linear in the register: a 32x32 bit matrix,
 * kept as four byte tables. It joins three streams summed side by side. */
typedef struct {
    uint32_t t[4][256];
} CrcShift;

static void
crc_init_shift(CrcShift *shift, size_t n)
{
    uint32_t basis[32];
    for (int bit = 0; bit < 32; bit++) {
        uint32_t c = 1u << bit;
        for (size_t i = 0; i < n; i++) {
            c = (c >> 8) ^ crc_table[0][c & 0xFF];
        }
        basis[bit] = c;
    }
    for (int k = 0; k < 4; k++) {
        for (uint32_t b = 0; b < 256; b++) {
            uint32_t c = 0;
            for (int bit = 0; bit < 8; bit++) {
                if (b & (1u << bit)) {
                    c ^= basis[8 * k + bit];
                }
            }
            shift->t[k][b] = c;
        }
    }
}

static uint32_t
crc_shift(const CrcShift *shift, uint32_t crc)
{
    return shift->t[0][crc & 0xFF] ^ shift->t[1][(crc >> 8) & 0xFF] ^
           shift->t[2][(crc >> 16) & 0xFF] ^ shift->t[3][crc >> 24];
}

#if defined(CRC_X86)
/* The instruction's latency is 3 cycles and its throughput 1: three independent streams
 * keep it busy (7.2 GB/s for one stream here). Blocks of 3 x CRC_LONG bytes, then of
 * 3 x CRC_SHORT, then one stream for the rest. */
#define CRC_LONG  8192
#define CRC_SHORT 256
static CrcShift crc_long_shift, crc_short_shift;

__attribute__((target("sse4.2"))) static uint64_t
crc_sse42_blocks(uint64_t c0, const unsigned char **pp, size_t *np, size_t len,
                 const CrcShift *shift)
{
    const unsigned char *p = *pp;
    size_t n = *np;
    for (; n >= 3 * len; n -= 3 * len, p += 3 * len) {
        uint64_t c1 = 0, c2 = 0;
        for (size_t i = 0; i < len; i += 8) {
            uint64_t w0, w1, w2;
            memcpy(&w0, p + i, 8);
            memcpy(&w1, p + len + i, 8);
            memcpy(&w2, p + 2 * len + i, 8);
            c0 = _mm_crc32_u64(c0, w0);
            c1 = _mm_crc32_u64(c1, w1);
            c2 = _mm_crc32_u64(c2, w2);
        }
        c0 = crc_shift(shift, (uint32_t)c0) ^ (uint32_t)c1;
        c0 = crc_shift(shift, (uint32_t)c0) ^ (uint32_t)c2;
    }
    *pp = p;
    *np = n;
    return c0;
}

__attribute__((target("sse4.2"))) static uint32_t
crc_sse42(uint32_t crc, const unsigned char *p, size_t n)
{
    for (; n > 0 && ((uintptr_t)p & 7) != 0; n--) {
        crc = _mm_crc32_u8(crc, *p++);
    }
    uint64_t c = crc;
    c = crc_sse42_blocks(c, &p, &n, CRC_LONG, &crc_long_shift);
    c = crc_sse42_blocks(c, &p, &n, CRC_SHORT, &crc_short_shift);
    for (; n >= 8; n -= 8, p += 8) {
        uint64_t word;
        memcpy(&word, p, 8);
        c = _mm_crc32_u64(c, word);
    }
    crc = (uint32_t)c;
    for (; n > 0; n--) {
        crc = _mm_crc32_u8(crc, *p++);
    }
    return crc;
}
#endif

static uint32_t
crc_run(int hardware, uint32_t crc, const unsigned char *p, size_t n)
{
    crc = ~crc;
#if defined(CRC_X86)
    if (hardware) {
        return ~crc_sse42(crc, p, n);
    }
#else
    (void)hardware;
#endif
    return ~crc_portable(crc, p, n);
}

static PyObject *
crc_call(int hardware, PyObject *const *args, Py_ssize_t nargs, const char *name)
{
    if (nargs < 1 || nargs > 2) {
        PyErr_Format(PyExc_TypeError, "%s takes 1 or 2 arguments (%zd given)", name, nargs);
        return NULL;
    }
    unsigned long start = 0;
    if (nargs == 2) {
        if (!PyLong_Check(args[1])) {
            PyErr_Format(PyExc_TypeError, "%s: crc must be an int", name);
            return NULL;
        }
        start = PyLong_AsUnsignedLong(args[1]);
        if (start == (unsigned long)-1 && PyErr_Occurred()) {
            PyErr_Clear();
            start = ULONG_MAX; /* negative or too large: refused below */
        }
        if (start > 0xFFFFFFFFul) {
            PyErr_Format(PyExc_ValueError, "%s: crc must be in [0, 2**32)", name);
            return NULL;
        }
    }
    Py_buffer view;
    if (PyObject_GetBuffer(args[0], &view, PyBUF_SIMPLE) < 0) {
        return NULL; /* not a buffer, or not C-contiguous: the protocol's own error */
    }
    const unsigned char *p = view.buf;
    size_t n = (size_t)view.len;
    uint32_t crc;
    if (n >= CRC_NOGIL_BYTES) {
        Py_BEGIN_ALLOW_THREADS;
        crc = crc_run(hardware, (uint32_t)start, p, n);
        Py_END_ALLOW_THREADS;
    }
    else {
        crc = crc_run(hardware, (uint32_t)start, p, n);
    }
    PyBuffer_Release(&view);
    return PyLong_FromUnsignedLong(crc);
}

static PyObject *
crc32c_crc32c(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs)
{
    return crc_call(crc_hardware, args, nargs, "crc32c");
}

static PyObject *
crc32c_portable(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs)
{
    return crc_call(0, args, nargs, "portable");
}

static PyMethodDef crc32c_functions[] = {
    {"crc32c", (PyCFunction)(void (*)(void))crc32c_crc32c, METH_FASTCALL,
     "crc32c(data, crc=0): the CRC-32C of data, continuing from crc"},
    {"portable", (PyCFunction)(void (*)(void))crc32c_portable, METH_FASTCALL,
     "portable(data, crc=0): crc32c without the CPU's instruction"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef crc32c_module = {
    .m_base = PyModuleDef_HEAD_INIT,
    .m_name = "_crc32c",
    .m_doc = "CRC-32C of a buffer, with SSE4.2 where the CPU has it.",
    .m_size = -1,
    .m_methods = crc32c_functions,
};

PyMODINIT_FUNC
PyInit__crc32c(void)
{
    crc_init_table();
#if defined(CRC_X86)
    __builtin_cpu_init();
    crc_hardware = __builtin_cpu_supports("sse4.2") != 0;
    if (crc_hardware) {
        crc_init_shift(&crc_long_shift, CRC_LONG);
        crc_init_shift(&crc_short_shift, CRC_SHORT);
    }
#endif
    PyObject *m = PyModule_Create(&crc32c_module);
    if (m != NULL && PyModule_AddIntConstant(m, "HARDWARE", crc_hardware) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
