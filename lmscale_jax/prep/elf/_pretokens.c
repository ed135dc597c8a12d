/* One function's x86-64 machine code -> its normalised pretoken text, in one call.

   The text is byte for byte what pretokenize.Pretokenizer makes of capstone's disasm_lite
   tuples (the reference): capstone's Intel syntax, its operand strings split into words by
   _OPERAND_RE's rules, numbers normalised (normalize_number), rip-relative displacements
   written <rip>, direct branch targets classed <self>/<fwd>/<back>/<ext>, "ptr" dropped,
   " [NEXT] " between instructions. Decoding stops at the first undecodable instruction.

   Why C: the Python loop around a decoder costs ~0.55 us per instruction even when every
   instruction's text is memoised (benchmarks/bench_prep.py, docs/data-preparation.md); here
   a function is one call and the per-instruction work is capstone's own decoding and printing
   plus a scan of its operand string.

   No link-time dependency on capstone: load() dlopens the library the capstone wheel ships
   (the one its Python binding uses, so the reference and this read the same decoder) and
   binds the five functions used. An editable install puts this module's .so in the source
   tree, where an rpath into site-packages would not hold; and the build needs no capstone
   headers: the few declarations below are capstone 5's ABI (capstone.h, CS_API_MAJOR 5),
   which load() checks with cs_version. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <dlfcn.h>
#include <stdbool.h>
#include <stdint.h>
#include <string.h>

/* ------------------------------------------------------------------ capstone 5's ABI */
typedef size_t csh;
typedef struct cs_insn {
  unsigned int id;
  uint64_t address;
  uint16_t size;
  uint8_t bytes[24];
  char mnemonic[32]; /* CS_MNEMONIC_SIZE */
  char op_str[160];
  void *detail;
} cs_insn;
enum { CS_ARCH_X86 = 3, CS_MODE_64 = 1 << 3, CS_API_MAJOR = 5 };

static unsigned (*cs_version_)(int *major, int *minor);
static int (*cs_open_)(int arch, int mode, csh *handle);
static cs_insn *(*cs_malloc_)(csh handle);
static bool (*cs_disasm_iter_)(csh handle, const uint8_t **code, size_t *size,
                               uint64_t *address, cs_insn *insn);
static const char *(*cs_strerror_)(int err);

static csh handle;
static cs_insn *insn; /* one instruction, reused: cs_disasm_iter's way (no array per call) */

/* ------------------------------------------------------------------ output buffer */
static char *out;
static size_t out_cap;

static int reserve(size_t need) {
  if (need <= out_cap) return 0;
  size_t cap = out_cap ? out_cap : 1 << 16;
  while (cap < need) cap *= 2;
  char *p = PyMem_RawRealloc(out, cap);
  if (!p) return -1;
  out = p;
  out_cap = cap;
  return 0;
}

/* The most one instruction adds: separator, mnemonic, a space, and its operand words. A word
   of n >= 1 characters becomes at most n + 6 (a 1-digit number "8" -> "0x8", "0x1" -> "<rip>",
   "0x100" -> "<imm16>") plus a space, so 8 per operand character bounds it. */
#define INSN_MAX (8 + 32 + 1 + 8 * 160 + 16)

/* ------------------------------------------------------------------ numbers */
static const char HEX[] = "0123456789abcdef";

static char *put_hex(char *o, uint64_t v) { /* Python's hex(v) */
  char tmp[16];
  int n = 0;
  do {
    tmp[n++] = HEX[v & 15];
    v >>= 4;
  } while (v);
  *o++ = '0';
  *o++ = 'x';
  while (n) *o++ = tmp[--n];
  return o;
}

static char *put_str(char *o, const char *s, size_t n) {
  memcpy(o, s, n);
  return o + n;
}

static bool pow2(uint64_t v) { return v && !(v & (v - 1)); }

/* pretokenize._SPECIAL_VALUES: powers of two, low-bit masks (2^k - 1, k >= 1), and the 64-
   and 32-bit two's complements of powers of two (alignment masks). */
static bool special(uint64_t v) {
  if (pow2(v) || (v && !(v & (v + 1))) || pow2(-v)) return true;
  return v && v <= 0xFFFFFFFFu && pow2(0x100000000ull - v);
}

static char *put_number(char *o, uint64_t v) { /* pretokenize.normalize_number */
  if (v <= 0xFF || special(v)) return put_hex(o, v);
  if (v <= 0xFFFF) return put_str(o, "<imm16>", 7);
  if (v <= 0xFFFFFFFFu) return put_str(o, "<imm32>", 7);
  return put_str(o, "<imm64>", 7);
}

static int hexval(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

/* ------------------------------------------------------------------ operands */
static bool is_digit(char c) { return c >= '0' && c <= '9'; }
static bool is_word_start(char c) {
  return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_';
}
static bool is_word(char c) { return is_word_start(c) || is_digit(c) || c == '.'; }
/* Python's \s on ASCII (str patterns): also \x1c-\x1f. Commas separate nothing either. */
static bool is_gap(char c) {
  return c == ' ' || (c >= '\t' && c <= '\r') || (c >= 0x1c && c <= 0x1f) || c == ',';
}

/* pretokenize._RIP_RE: "rip + 0x18" -> "rip + " and a '\0' (the one-character word that
   becomes <rip>); only hex displacements (capstone writes 0-9 in decimal: "rip + 8" stays a
   number, as in the reference). Returns the new length. */
static size_t mark_rip(const char *s, size_t n, char *dst) {
  size_t i = 0, j = 0;
  while (i < n) {
    if (i + 8 < n && !memcmp(s + i, "rip ", 4) && (s[i + 4] == '+' || s[i + 4] == '-') &&
        s[i + 5] == ' ' && s[i + 6] == '0' && s[i + 7] == 'x' &&
        ((s[i + 8] >= '0' && s[i + 8] <= '9') || (s[i + 8] >= 'a' && s[i + 8] <= 'f'))) {
      memcpy(dst + j, s + i, 6);
      j += 6;
      dst[j++] = '\0';
      i += 8;
      while (i < n && ((s[i] >= '0' && s[i] <= '9') || (s[i] >= 'a' && s[i] <= 'f'))) i++;
    } else {
      dst[j++] = s[i++];
    }
  }
  return j;
}

/* pretokenize._operand_words: the words of _OPERAND_RE
   (0x[0-9a-fA-F]+ | \d+ | [A-Za-z_][A-Za-z0-9_.]* | [^\s,]), numbers normalised, "ptr"
   dropped, '\0' written <rip>, joined by single spaces. */
static char *put_operands(char *o, const char *op_str) {
  size_t n = strlen(op_str);
  char marked[2 * 160];
  const char *s = op_str;
  if (strstr(op_str, "rip")) {
    n = mark_rip(op_str, n, marked);
    s = marked;
  }
  char *first = o;
  size_t i = 0;
  while (i < n) {
    char c = s[i];
    if (is_gap(c)) {
      i++;
      continue;
    }
    if (o != first) *o++ = ' ';
    if (c == '0' && i + 2 < n && s[i + 1] == 'x' && hexval(s[i + 2]) >= 0) {
      uint64_t v = 0;
      int h;
      for (i += 2; i < n && (h = hexval(s[i])) >= 0; i++) v = v << 4 | (uint64_t)h;
      o = put_number(o, v); /* wraps mod 2^64: the reference masks with _MASK64 */
    } else if (is_digit(c)) {
      uint64_t v = 0;
      for (; i < n && is_digit(s[i]); i++) v = v * 10 + (uint64_t)(s[i] - '0');
      o = put_number(o, v);
    } else if (is_word_start(c)) {
      size_t b = i;
      while (i < n && is_word(s[i])) i++;
      if (i - b == 3 && !memcmp(s + b, "ptr", 3)) {
        if (o != first) o--; /* the space written before it */
      } else {
        o = put_str(o, s + b, i - b);
      }
    } else if (c == '\0') {
      o = put_str(o, "<rip>", 5);
      i++;
    } else {
      *o++ = c;
      i++;
    }
  }
  return o;
}

/* ------------------------------------------------------------------ branches */
/* pretokenize._BRANCHES */
static const char *const BRANCHES[] = {
    "call", "jmp", "ja", "jae", "jb", "jbe", "jc", "je", "jg", "jge", "jl", "jle", "jna",
    "jnae", "jnb", "jnbe", "jnc", "jne", "jng", "jnge", "jnl", "jnle", "jno", "jnp", "jns",
    "jnz", "jo", "jp", "jpe", "jpo", "js", "jz", "jcxz", "jecxz", "jrcxz", "loop", "loope",
    "loopne", "xbegin"};

static bool is_branch(const char *mnemonic) {
  char c = mnemonic[0];
  if (c != 'c' && c != 'j' && c != 'l' && c != 'x') return false;
  for (size_t k = 0; k < sizeof BRANCHES / sizeof *BRANCHES; k++)
    if (!strcmp(mnemonic, BRANCHES[k])) return true;
  return false;
}

/* pretokenize._HEX_RE.fullmatch: "0x" and lowercase hex digits, nothing else. */
static bool parse_target(const char *s, uint64_t *target) {
  uint64_t v = 0;
  const char *p = s + 2;
  if (!*p) return false;
  for (; *p; p++) {
    if (*p >= '0' && *p <= '9') v = v << 4 | (uint64_t)(*p - '0');
    else if (*p >= 'a' && *p <= 'f') v = v << 4 | (uint64_t)(*p - 'a' + 10);
    else return false;
  }
  *target = v;
  return true;
}

/* Pretokenizer.function_text's text of one instruction. */
static char *put_insn(char *o, const cs_insn *in, uint64_t start, uint64_t end) {
  o = put_str(o, in->mnemonic, strlen(in->mnemonic));
  const char *ops = in->op_str;
  if (!ops[0]) return o;
  *o++ = ' ';
  uint64_t t;
  if (ops[0] == '0' && ops[1] == 'x' && is_branch(in->mnemonic) && parse_target(ops, &t)) {
    if (t == start) return put_str(o, "<self>", 6);
    if (start <= t && t < end) return put_str(o, t > in->address ? "<fwd>" : "<back>",
                                              t > in->address ? 5 : 6);
    return put_str(o, "<ext>", 5);
  }
  return put_operands(o, ops);
}

/* ------------------------------------------------------------------ module functions */
static int need_loaded(void) {
  if (insn) return 0;
  PyErr_SetString(PyExc_RuntimeError,
                  "lmscale_jax.prep._pretokens: capstone not loaded; call load(path) first");
  return -1;
}

static int read_args(PyObject *const *args, Py_ssize_t nargs, const char *name,
                     Py_buffer *code, uint64_t *start) {
  if (nargs != 2) {
    PyErr_Format(PyExc_TypeError, "%s(code, start) takes 2 arguments (%zd given)", name, nargs);
    return -1;
  }
  if (need_loaded()) return -1;
  *start = PyLong_AsUnsignedLongLong(args[1]);
  if (*start == (uint64_t)-1 && PyErr_Occurred()) return -1;
  return PyObject_GetBuffer(args[0], code, PyBUF_SIMPLE);
}

PyDoc_STRVAR(function_text_doc,
             "function_text(code, start) -> (text, bytes decoded): the normalised pretokens of "
             "the instructions of `code` at address `start` up to the first undecodable one.");

static PyObject *function_text(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
  Py_buffer code;
  uint64_t start;
  if (read_args(args, nargs, "function_text", &code, &start)) return NULL;
  const uint8_t *p = code.buf;
  size_t left = (size_t)code.len;
  uint64_t address = start, end = start + (uint64_t)code.len;
  size_t n = 0;
  while (cs_disasm_iter_(handle, &p, &left, &address, insn)) {
    if (reserve(n + INSN_MAX)) {
      PyBuffer_Release(&code);
      return PyErr_NoMemory();
    }
    if (n) n = (size_t)(put_str(out + n, " [NEXT] ", 8) - out);
    n = (size_t)(put_insn(out + n, insn, start, end) - out);
  }
  Py_ssize_t decoded = (Py_ssize_t)(p - (const uint8_t *)code.buf);
  PyBuffer_Release(&code);
  PyObject *text = PyUnicode_New((Py_ssize_t)n, 127);
  if (!text) return NULL;
  if (n) memcpy(PyUnicode_1BYTE_DATA(text), out, n);
  return Py_BuildValue("(Nn)", text, decoded);
}

PyDoc_STRVAR(decode_only_doc,
             "decode_only(code, start) -> (instructions, bytes decoded): capstone's decoding "
             "and printing alone, no pretokens (the benchmark's floor of function_text).");

static PyObject *decode_only(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
  Py_buffer code;
  uint64_t start;
  if (read_args(args, nargs, "decode_only", &code, &start)) return NULL;
  const uint8_t *p = code.buf;
  size_t left = (size_t)code.len;
  Py_ssize_t count = 0;
  while (cs_disasm_iter_(handle, &p, &left, &start, insn)) count++;
  Py_ssize_t decoded = (Py_ssize_t)(p - (const uint8_t *)code.buf);
  PyBuffer_Release(&code);
  return Py_BuildValue("(nn)", count, decoded);
}

static void *bind(void *lib, const char *name, const char *path) {
  void *f = dlsym(lib, name);
  if (!f) PyErr_Format(PyExc_ImportError, "%s has no %s: not a capstone library", path, name);
  return f;
}

PyDoc_STRVAR(load_doc,
             "load(path) -> (major, minor): opens capstone's shared library at `path` (x86-64, "
             "Intel syntax, no details); once per process, later calls return its version.");

static PyObject *load(PyObject *self, PyObject *arg) {
  int major = 0, minor = 0;
  if (insn) {
    cs_version_(&major, &minor);
    return Py_BuildValue("(ii)", major, minor);
  }
  const char *path = PyUnicode_AsUTF8(arg);
  if (!path) return NULL;
  void *lib = dlopen(path, RTLD_NOW | RTLD_LOCAL);
  if (!lib) {
    PyErr_Format(PyExc_ImportError, "cannot open capstone library %s: %s", path, dlerror());
    return NULL;
  }
  if (!(cs_version_ = bind(lib, "cs_version", path)) || !(cs_open_ = bind(lib, "cs_open", path)) ||
      !(cs_malloc_ = bind(lib, "cs_malloc", path)) ||
      !(cs_disasm_iter_ = bind(lib, "cs_disasm_iter", path)) ||
      !(cs_strerror_ = bind(lib, "cs_strerror", path)))
    return NULL;
  cs_version_(&major, &minor);
  if (major != CS_API_MAJOR) {
    PyErr_Format(PyExc_ImportError,
                 "%s is capstone %d.%d; lmscale_jax.prep._pretokens is built for capstone %d "
                 "(install capstone>=5,<6 or force LMSCALE_PRETOKENIZER=python)",
                 path, major, minor, CS_API_MAJOR);
    return NULL;
  }
  int err = cs_open_(CS_ARCH_X86, CS_MODE_64, &handle);
  if (err) {
    PyErr_Format(PyExc_ImportError, "capstone cs_open(x86, 64): %s", cs_strerror_(err));
    return NULL;
  }
  if (!(insn = cs_malloc_(handle))) return PyErr_NoMemory();
  return Py_BuildValue("(ii)", major, minor);
}

static PyMethodDef methods[] = {
    {"load", load, METH_O, load_doc},
    {"function_text", (PyCFunction)(void (*)(void))function_text, METH_FASTCALL,
     function_text_doc},
    {"decode_only", (PyCFunction)(void (*)(void))decode_only, METH_FASTCALL, decode_only_doc},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "lmscale_jax.prep._pretokens",
    "x86-64 function bytes -> normalised pretoken text through capstone (see _pretokens.c).",
    -1, methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__pretokens(void) { return PyModule_Create(&module); }
