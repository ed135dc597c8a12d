/* Pass 3's per-token work on binary code, in C: instruction counts, token ids, packing.

   A function's text is its instructions joined by " [NEXT] " (_pretokens.c). The Python
   reference of each function here, which stays the fallback where this cannot build:
     count(texts, sep)      store/tokenizer.count_pretokens' per-instruction Counter;
     Encoder(...).encode    tokenize_pack.PretokenIds.encode (one lookup per instruction);
     pack(...)              prep/packing.Packer (best-fit over a window of open sequences).
   Outputs are identical (tests/test_token_ids_compiled.py).

   Why C: over Python's str.split, dict lookups and bytes.join these were 4.8 s of an 18 s
   one-worker run (benchmarks/bench_prep.py, 21 MB of code: tokenize 3.8 s, pack 1.0 s), the
   biggest stage after capstone's own decoding; after, 1.1 s and 0.1 s. Here an instruction is
   a hash of its bytes and a probe of a table with no Python object made, a new instruction's
   ids are its words' from a second table (Python is asked once per distinct word), and
   packing never leaves C. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdbool.h>
#include <stdint.h>
#include <string.h>

/* ------------------------------------------------------------------ growable buffers */
static int grow(void **buf, size_t *cap, size_t need, size_t item) {
  if (need <= *cap) return 0;
  size_t c = *cap ? *cap : 1024;
  while (c < need) c *= 2;
  void *p = PyMem_RawRealloc(*buf, c * item);
  if (!p) {
    PyErr_NoMemory();
    return -1;
  }
  *buf = p;
  *cap = c;
  return 0;
}

/* ------------------------------------------------------------------ byte-string table */
/* Open addressing; a slot holds the hash's top bits, the key's length and where its record is.
   A record (its value, then its key bytes, then its token ids) lies in one arena, so a hit
   reads one slot and one record: the instruction table outgrows the caches (150k distinct
   instructions in 21 MB of code) and each separate array cost a cache miss more per lookup. */
typedef struct {
  int64_t value;     /* count's count */
  uint32_t len, ids; /* key bytes, id count */
} record;

typedef struct {
  uint32_t tag, len;
  size_t at; /* the record's offset + 1; 0 = empty */
} slot;

typedef struct {
  char *arena;
  size_t arena_len, arena_cap;
  size_t *order; /* the records' offsets, first inserted first */
  size_t n, order_cap;
  slot *slots;
  size_t mask;
} table;

static uint64_t hash_bytes(const char *s, size_t n) { /* 8 bytes a step, then a final mix */
  uint64_t h = 0x9E3779B97F4A7C15ULL ^ n, w;
  for (; n >= 8; s += 8, n -= 8) {
    memcpy(&w, s, 8);
    h = (h ^ w) * 0xBF58476D1CE4E5B9ULL;
    h ^= h >> 29;
  }
  w = 0;
  memcpy(&w, s, n);
  h = (h ^ w) * 0x94D049BB133111EBULL;
  return h ^ (h >> 31);
}

static record *rec(const table *t, size_t at) { return (record *)(t->arena + at); }
static char *rec_key(const table *t, size_t at) { return t->arena + at + sizeof(record); }
static size_t ids_offset(const table *t, size_t at) {
  return (at + sizeof(record) + rec(t, at)->len + 1) & ~(size_t)1;
}
static const uint16_t *rec_ids(const table *t, size_t at) {
  return (const uint16_t *)(t->arena + ids_offset(t, at));
}

static void table_free(table *t) {
  PyMem_RawFree(t->arena);
  PyMem_RawFree(t->order);
  PyMem_RawFree(t->slots);
  memset(t, 0, sizeof *t);
}

static void table_clear(table *t) {
  t->n = t->arena_len = 0;
  if (t->slots) memset(t->slots, 0, (t->mask + 1) * sizeof *t->slots);
}

static void put_slot(table *t, uint64_t h, uint32_t len, size_t at) {
  size_t i = h & t->mask;
  while (t->slots[i].at) i = (i + 1) & t->mask;
  t->slots[i] = (slot){.tag = (uint32_t)(h >> 32), .len = len, .at = at + 1};
}

static int rehash(table *t, size_t slots) {
  slot *s = PyMem_RawCalloc(slots, sizeof *s);
  if (!s) {
    PyErr_NoMemory();
    return -1;
  }
  PyMem_RawFree(t->slots);
  t->slots = s;
  t->mask = slots - 1;
  for (size_t k = 0; k < t->n; k++) {
    size_t at = t->order[k];
    uint32_t len = rec(t, at)->len;
    put_slot(t, hash_bytes(rec_key(t, at), len), len, at);
  }
  return 0;
}

/* The record of key s[0:n] (*found), or a new one (no ids, value 0): its offset; -1 on no
   memory. */
static Py_ssize_t table_find(table *t, const char *s, size_t n, bool *found) {
  if (2 * (t->n + 1) > t->mask + 1 && rehash(t, t->slots ? 2 * (t->mask + 1) : 1024)) return -1;
  uint64_t h = hash_bytes(s, n);
  uint32_t tag = (uint32_t)(h >> 32);
  for (size_t i = h & t->mask; t->slots[i].at; i = (i + 1) & t->mask) {
    const slot *x = &t->slots[i];
    if (x->tag == tag && x->len == n && !memcmp(rec_key(t, x->at - 1), s, n)) {
      *found = true;
      return (Py_ssize_t)(x->at - 1);
    }
  }
  size_t at = (t->arena_len + 7) & ~(size_t)7;
  if (grow((void **)&t->order, &t->order_cap, t->n + 1, sizeof *t->order) ||
      grow((void **)&t->arena, &t->arena_cap, at + sizeof(record) + n + 1, 1))
    return -1;
  *rec(t, at) = (record){.value = 0, .len = (uint32_t)n, .ids = 0};
  memcpy(rec_key(t, at), s, n);
  t->arena_len = ids_offset(t, at);
  t->order[t->n++] = at;
  put_slot(t, h, (uint32_t)n, at);
  *found = false;
  return (Py_ssize_t)at;
}

/* Gives the newest record, at `at`, its `count` ids. */
static int table_set_ids(table *t, size_t at, const uint16_t *ids, size_t count) {
  if (grow((void **)&t->arena, &t->arena_cap, ids_offset(t, at) + 2 * count, 1)) return -1;
  memcpy(t->arena + ids_offset(t, at), ids, 2 * count);
  rec(t, at)->ids = (uint32_t)count;
  t->arena_len = ids_offset(t, at) + 2 * count;
  return 0;
}

/* The next piece of s[0:n] before separator sep (str.split's): its length; *next is where
   the piece after it starts, or NULL after the last piece. A byte loop: glibc's memmem costs
   more per call than the ~20 bytes of an instruction it would skip. */
static size_t next_piece(const char *s, size_t n, const char *sep, size_t sep_len,
                         const char **next) {
  for (size_t i = 0; i + sep_len <= n; i++)
    if (s[i] == sep[0] && !memcmp(s + i, sep, sep_len)) {
      *next = s + i + sep_len;
      return i;
    }
  *next = NULL;
  return n;
}

static const char *utf8_of(PyObject *text, Py_ssize_t *n, const char *what) {
  if (!PyUnicode_Check(text)) {
    PyErr_Format(PyExc_TypeError, "%s: expected str, got %.100s", what, Py_TYPE(text)->tp_name);
    return NULL;
  }
  return PyUnicode_AsUTF8AndSize(text, n);
}

/* Calls fn(ctx, word, length) for each of str.split()'s words of s[0:n]; stops at the first
   nonzero return, which it returns. Pretoken text is printable ASCII with single spaces;
   anything else (other whitespace, non-ASCII) is split by Python's own str.split. */
typedef int (*word_fn)(void *ctx, const char *word, size_t n);

static int for_each_word(const char *s, size_t n, word_fn fn, void *ctx) {
  bool plain = true;
  for (size_t j = 0; j < n && plain; j++) plain = s[j] > ' ' ? s[j] < 0x7f : s[j] == ' ';
  if (plain) {
    for (size_t i = 0; i < n;) {
      while (i < n && s[i] == ' ') i++;
      size_t start = i;
      while (i < n && s[i] != ' ') i++;
      int r = i > start ? fn(ctx, s + start, i - start) : 0;
      if (r) return r;
    }
    return 0;
  }
  PyObject *text = PyUnicode_DecodeUTF8(s, (Py_ssize_t)n, NULL);
  PyObject *words = text ? PyUnicode_Split(text, NULL, -1) : NULL;
  Py_XDECREF(text);
  if (!words) return -1;
  int r = 0;
  for (Py_ssize_t w = 0; w < PyList_GET_SIZE(words) && !r; w++) {
    Py_ssize_t len;
    const char *word = PyUnicode_AsUTF8AndSize(PyList_GET_ITEM(words, w), &len);
    r = word ? fn(ctx, word, (size_t)len) : -1;
  }
  Py_DECREF(words);
  return r;
}

/* ------------------------------------------------------------------ count */
typedef struct {
  table *t;
  int64_t n;
} word_count;

static int add_count(void *ctx, const char *word, size_t n) {
  word_count *c = ctx;
  bool found;
  Py_ssize_t at = table_find(c->t, word, n, &found);
  if (at < 0) return -1;
  rec(c->t, (size_t)at)->value += c->n;
  return 0;
}

/* Each `sep`-separated piece of the texts, counted into t. */
static int count_pieces(table *t, PyObject *texts, const char *sep, size_t sep_len) {
  PyObject *it = PyObject_GetIter(texts), *text;
  if (!it) return -1;
  while ((text = PyIter_Next(it))) {
    Py_ssize_t n;
    const char *s = utf8_of(text, &n, "count text"), *next = s;
    while (next) {
      const char *piece = next;
      size_t len = next_piece(piece, (size_t)(s + n - piece), sep, sep_len, &next);
      if (add_count(&(word_count){t, 1}, piece, len)) break;
    }
    Py_DECREF(text);
    if (PyErr_Occurred()) break;
  }
  Py_DECREF(it);
  return PyErr_Occurred() ? -1 : 0;
}

static PyObject *counts_dict(const table *t) {
  PyObject *out = PyDict_New();
  for (size_t k = 0; out && k < t->n; k++) {
    const record *x = rec(t, t->order[k]);
    PyObject *key = PyUnicode_DecodeUTF8(rec_key(t, t->order[k]), (Py_ssize_t)x->len, NULL);
    PyObject *value = key ? PyLong_FromLongLong(x->value) : NULL;
    if (!value || PyDict_SetItem(out, key, value)) Py_CLEAR(out);
    Py_XDECREF(key);
    Py_XDECREF(value);
  }
  return out;
}

PyDoc_STRVAR(count_doc,
             "count(texts, sep, words=False) -> {piece: count}: how often each `sep`-separated "
             "piece occurs in the texts (str.split(sep) of each, counted), first seen first; "
             "words: the counts of the pieces' words (str.split()) instead.");

static PyObject *count(PyObject *self, PyObject *args, PyObject *kwargs) {
  static char *names[] = {"texts", "sep", "words", NULL};
  PyObject *texts, *sep_obj;
  int words = 0;
  if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OU|p:count", names, &texts, &sep_obj, &words))
    return NULL;
  Py_ssize_t sep_len;
  const char *sep = utf8_of(sep_obj, &sep_len, "count sep");
  if (!sep) return NULL;
  if (!sep_len) return PyErr_Format(PyExc_ValueError, "count: empty separator");
  table pieces = {0}, word_table = {0};
  PyObject *out = NULL;
  if (count_pieces(&pieces, texts, sep, (size_t)sep_len)) goto done;
  if (!words) {
    out = counts_dict(&pieces);
    goto done;
  }
  for (size_t k = 0; k < pieces.n; k++) {
    size_t at = pieces.order[k];
    word_count c = {&word_table, rec(&pieces, at)->value};
    if (for_each_word(rec_key(&pieces, at), rec(&pieces, at)->len, add_count, &c)) goto done;
  }
  out = counts_dict(&word_table);
done:
  table_free(&pieces);
  table_free(&word_table);
  return out;
}

/* ------------------------------------------------------------------ Encoder */
typedef struct {
  PyObject_HEAD
  PyObject *word_ids;    /* word str -> its token ids (uint16 bytes) */
  char *sep;             /* the instructions' separator, UTF-8 */
  size_t sep_len;
  uint16_t *sep_ids;     /* the separator's ids */
  size_t sep_ids_len;
  size_t max_entries;    /* the instruction table is emptied when it holds this many */
  table instructions, words;
  uint16_t *scratch;     /* one new instruction's ids */
  size_t scratch_cap;
  uint16_t *out;
  size_t out_cap;
} Encoder;

static void Encoder_dealloc(Encoder *e) {
  Py_XDECREF(e->word_ids);
  PyMem_RawFree(e->sep);
  PyMem_RawFree(e->sep_ids);
  PyMem_RawFree(e->scratch);
  PyMem_RawFree(e->out);
  table_free(&e->instructions);
  table_free(&e->words);
  Py_TYPE(e)->tp_free((PyObject *)e);
}

static int Encoder_init(Encoder *e, PyObject *args, PyObject *kwargs) {
  static char *names[] = {"word_ids", "sep", "sep_ids", "max_entries", NULL};
  PyObject *word_ids, *sep_obj;
  Py_buffer sep_ids;
  Py_ssize_t max_entries = 1 << 18;
  if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OUy*|n:Encoder", names, &word_ids, &sep_obj,
                                   &sep_ids, &max_entries))
    return -1;
  int bad = -1;
  Py_ssize_t sep_len;
  const char *sep = utf8_of(sep_obj, &sep_len, "Encoder sep");
  if (!sep) goto done;
  if (!PyCallable_Check(word_ids) || !sep_len || sep_ids.len % 2 || max_entries < 1) {
    PyErr_SetString(PyExc_ValueError, "Encoder(word_ids, sep, sep_ids, max_entries): word_ids "
                    "a callable, sep not empty, sep_ids uint16 bytes, max_entries >= 1");
    goto done;
  }
  if (!(e->sep = PyMem_RawMalloc((size_t)sep_len)) ||
      !(e->sep_ids = PyMem_RawMalloc((size_t)sep_ids.len + 1))) {
    PyErr_NoMemory();
    goto done;
  }
  memcpy(e->sep, sep, (size_t)sep_len);
  memcpy(e->sep_ids, sep_ids.buf, (size_t)sep_ids.len);
  e->sep_len = (size_t)sep_len;
  e->sep_ids_len = (size_t)sep_ids.len / 2;
  e->max_entries = (size_t)max_entries;
  Py_INCREF(word_ids);
  Py_XSETREF(e->word_ids, word_ids);
  bad = 0;
done:
  PyBuffer_Release(&sep_ids);
  return bad;
}

/* Appends the ids of word s[0:n] to the scratch at *used, asking `word_ids` the first time. */
static int add_word(Encoder *e, const char *s, size_t n, size_t *used) {
  bool found;
  Py_ssize_t k = table_find(&e->words, s, n, &found);
  if (k < 0) return -1;
  if (!found) {
    PyObject *word = PyUnicode_DecodeUTF8(s, (Py_ssize_t)n, NULL);
    PyObject *ids = word ? PyObject_CallOneArg(e->word_ids, word) : NULL;
    char *b = NULL;
    Py_ssize_t len = 0;
    if (ids && (PyBytes_AsStringAndSize(ids, &b, &len) || len % 2) && !PyErr_Occurred())
      PyErr_Format(PyExc_ValueError, "Encoder word_ids(%R) returned %zd bytes: not uint16 ids",
                   word, len);
    if (!PyErr_Occurred()) table_set_ids(&e->words, (size_t)k, (const uint16_t *)b, (size_t)len / 2);
    Py_XDECREF(word);
    Py_XDECREF(ids);
    if (PyErr_Occurred()) { /* the new word has no ids: start again from empty */
      table_clear(&e->words);
      return -1;
    }
  }
  size_t count = rec(&e->words, (size_t)k)->ids;
  if (grow((void **)&e->scratch, &e->scratch_cap, *used + count, sizeof *e->scratch)) return -1;
  memcpy(e->scratch + *used, rec_ids(&e->words, (size_t)k), 2 * count);
  *used += count;
  return 0;
}

typedef struct {
  Encoder *e;
  size_t used;
} scratch_fill;

static int add_word_ids(void *ctx, const char *word, size_t n) {
  scratch_fill *f = ctx;
  return add_word(f->e, word, n, &f->used);
}

/* The ids of the words of instruction s[0:n] into the scratch: their count, or -1. */
static Py_ssize_t instruction_words(Encoder *e, const char *s, size_t n) {
  scratch_fill f = {e, 0};
  return for_each_word(s, n, add_word_ids, &f) ? -1 : (Py_ssize_t)f.used;
}

/* The entry of one instruction, its ids made from its words' the first time. */
static Py_ssize_t instruction_entry(Encoder *e, const char *s, size_t n) {
  table *t = &e->instructions;
  if (t->n >= e->max_entries) { /* bounded: a corpus holds millions of instructions */
    table_clear(t);
  }
  bool found;
  Py_ssize_t k = table_find(t, s, n, &found);
  if (k < 0 || found) return k;
  Py_ssize_t count = instruction_words(e, s, n);
  if (count < 0 || table_set_ids(t, (size_t)k, e->scratch, (size_t)count)) {
    table_clear(t); /* the new entry has no ids: start again from empty */
    return -1;
  }
  return k;
}

PyDoc_STRVAR(encode_doc,
             "encode(text) -> bytes: the uint16 ids of the text's instructions (sep-separated), "
             "sep_ids between them; an instruction's ids are its words' (str.split()), a word's "
             "come from word_ids(word) once.");

static PyObject *Encoder_encode(Encoder *e, PyObject *text) {
  Py_ssize_t n;
  const char *s = utf8_of(text, &n, "Encoder.encode");
  if (!s) return NULL;
  size_t used = 0;
  for (const char *next = s; next;) {
    const char *piece = next;
    size_t len = next_piece(piece, (size_t)(s + n - piece), e->sep, e->sep_len, &next);
    Py_ssize_t k = instruction_entry(e, piece, len);
    if (k < 0) return NULL;
    size_t count = rec(&e->instructions, (size_t)k)->ids;
    if (grow((void **)&e->out, &e->out_cap, used + count + e->sep_ids_len, sizeof *e->out))
      return NULL;
    if (used) {
      memcpy(e->out + used, e->sep_ids, e->sep_ids_len * sizeof *e->out);
      used += e->sep_ids_len;
    }
    memcpy(e->out + used, rec_ids(&e->instructions, (size_t)k), count * sizeof *e->out);
    used += count;
  }
  return PyBytes_FromStringAndSize((const char *)e->out, (Py_ssize_t)(used * sizeof *e->out));
}

static PyMethodDef Encoder_methods[] = {
    {"encode", (PyCFunction)Encoder_encode, METH_O, encode_doc}, {NULL, NULL, 0, NULL}};

static PyTypeObject EncoderType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "lmscale_jax.prep._token_ids.Encoder",
    .tp_basicsize = sizeof(Encoder),
    .tp_dealloc = (destructor)Encoder_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Encoder(word_ids, sep, sep_ids, max_entries=2**18): instruction texts -> ids.",
    .tp_methods = Encoder_methods,
    .tp_init = (initproc)Encoder_init,
    .tp_new = PyType_GenericNew,
};

/* ------------------------------------------------------------------ pack */
typedef struct {
  size_t free, pieces;
  size_t *at, *len; /* the pieces' spans of the input ids */
} open_sequence;

typedef struct {
  const uint16_t *ids;
  size_t seq_len;
  uint16_t cls, sep, pad;
  uint16_t *out;
  size_t out_len, out_cap; /* in sequences */
} packing;

static int emit(packing *p, const size_t *at, const size_t *len, size_t pieces) {
  if (grow((void **)&p->out, &p->out_cap, p->out_len + 1, p->seq_len * sizeof *p->out))
    return -1;
  uint16_t *o = p->out + p->out_len++ * p->seq_len;
  size_t i = 0;
  for (size_t j = 0; j < pieces; j++) {
    o[i] = p->cls;
    memcpy(o + i + 1, p->ids + at[j], len[j] * sizeof *o);
    o[i + 1 + len[j]] = p->sep;
    i += len[j] + 2;
  }
  for (; i < p->seq_len; i++) o[i] = p->pad;
  return 0;
}

PyDoc_STRVAR(pack_doc,
             "pack(ids, lengths, seq_len, cls, sep, pad, window, greedy) -> bytes: the "
             "documents ids[sum(lengths[:i]):][:lengths[i]] (uint16, lengths int64) packed as "
             "prep/packing.Packer(seq_len, cls, sep, pad, 'greedy' or 'none', window) packs "
             "them, add() of each then flush(): the sequences' uint16 ids, one after another.");

static PyObject *pack(PyObject *self, PyObject *args) {
  Py_buffer ids, lengths;
  Py_ssize_t seq_len, window;
  int cls, sep, pad, greedy;
  if (!PyArg_ParseTuple(args, "y*y*niiinp:pack", &ids, &lengths, &seq_len, &cls, &sep, &pad,
                        &window, &greedy))
    return NULL;
  PyObject *result = NULL;
  open_sequence *open = NULL, **order = NULL;
  size_t *spans = NULL;
  packing p = {.ids = ids.buf, .seq_len = (size_t)seq_len, .cls = (uint16_t)cls,
               .sep = (uint16_t)sep, .pad = (uint16_t)pad};
  const int64_t *lens = lengths.buf;
  size_t docs = (size_t)lengths.len / sizeof *lens, total = 0;
  bool negative = false;
  for (size_t d = 0; d < docs; d++) {
    negative |= lens[d] < 0;
    total += lens[d] > 0 ? (size_t)lens[d] : 0;
  }
  if (seq_len < 4 || window < 1 || lengths.len % (Py_ssize_t)sizeof *lens || negative ||
      total * 2 != (size_t)ids.len) {
    PyErr_Format(PyExc_ValueError, "pack: seq_len %zd (>= 4), window %zd (>= 1), %zd length "
                 "bytes (int64, none negative) summing to %zu ids, ids %zd bytes (uint16)",
                 seq_len, window, lengths.len, total, ids.len);
    goto done;
  }
  size_t room = (size_t)seq_len - 2, slots = (size_t)window + 1, most = (size_t)seq_len / 3 + 1;
  open = PyMem_RawCalloc(slots, sizeof *open);
  spans = PyMem_RawMalloc(2 * slots * most * sizeof *spans);
  /* The open list: pointers to the slots in Packer._open's order; idle: the free slots. */
  order = PyMem_RawMalloc(2 * slots * sizeof *order);
  if (!open || !spans || !order) {
    PyErr_NoMemory();
    goto done;
  }
  open_sequence **idle = order + slots;
  for (size_t i = 0; i < slots; i++) {
    open[i].at = spans + 2 * i * most;
    open[i].len = open[i].at + most;
    idle[i] = &open[i];
  }
  size_t n_open = 0, n_idle = slots, at = 0;
  for (size_t d = 0; d < docs; at += (size_t)lens[d], d++) {
    for (size_t start = 0; start < (size_t)lens[d]; start += room) {
      size_t len = (size_t)lens[d] - start < room ? (size_t)lens[d] - start : room;
      if (!greedy || len == room) {
        size_t piece_at = at + start;
        if (emit(&p, &piece_at, &len, 1)) goto done;
        continue;
      }
      size_t need = len + 2, best = n_open;
      for (size_t i = 0; i < n_open; i++)
        if (order[i]->free >= need && (best == n_open || order[i]->free < order[best]->free))
          best = i;
      if (best == n_open) {
        open_sequence *s = idle[--n_idle];
        s->free = (size_t)seq_len;
        s->pieces = 0;
        order[n_open++] = s;
      }
      open_sequence *b = order[best];
      b->free -= need;
      b->at[b->pieces] = at + start;
      b->len[b->pieces++] = len;
      size_t out = n_open;
      if (b->free < 3)
        out = best;
      else if (n_open > (size_t)window)
        for (size_t i = out = 0; i < n_open; i++)
          if (order[i]->free < order[out]->free) out = i;
      if (out < n_open) {
        open_sequence *s = order[out];
        if (emit(&p, s->at, s->len, s->pieces)) goto done;
        memmove(order + out, order + out + 1, (n_open - out - 1) * sizeof *order);
        n_open--;
        idle[n_idle++] = s;
      }
    }
  }
  for (size_t i = 0; i < n_open; i++)
    if (emit(&p, order[i]->at, order[i]->len, order[i]->pieces)) goto done;
  result = PyBytes_FromStringAndSize((const char *)p.out,
                                     (Py_ssize_t)(p.out_len * p.seq_len * sizeof *p.out));
done:
  PyMem_RawFree(p.out);
  PyMem_RawFree(open);
  PyMem_RawFree(order);
  PyMem_RawFree(spans);
  PyBuffer_Release(&ids);
  PyBuffer_Release(&lengths);
  return result;
}

/* ------------------------------------------------------------------ module */
static PyMethodDef methods[] = {{"count", (PyCFunction)(void (*)(void))count,
                                 METH_VARARGS | METH_KEYWORDS, count_doc},
                                {"pack", pack, METH_VARARGS, pack_doc},
                                {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "lmscale_jax.prep._token_ids",
    "Instruction counts, token ids and packing of binary code in C (see _token_ids.c).", -1,
    methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__token_ids(void) {
  if (PyType_Ready(&EncoderType) < 0) return NULL;
  PyObject *m = PyModule_Create(&module);
  if (!m) return NULL;
  Py_INCREF(&EncoderType);
  if (PyModule_AddObject(m, "Encoder", (PyObject *)&EncoderType) < 0) {
    Py_DECREF(&EncoderType);
    Py_DECREF(m);
    return NULL;
  }
  return m;
}
