/* Small checksum and encoding routines for the similarity benchmark's test
   (tests/test_similarity.py). */
#include <stddef.h>
#include <stdint.h>

uint32_t crc32_bitwise(const uint8_t *p, size_t n) {
  uint32_t c = 0xffffffffu;
  while (n--) { c ^= *p++; for (int k = 0; k < 8; k++) c = c & 1 ? (c >> 1) ^ 0xedb88320u : c >> 1; }
  return ~c;
}

uint32_t adler32(const uint8_t *p, size_t n) {
  uint32_t a = 1, b = 0;
  while (n--) { a = (a + *p++) % 65521; b = (b + a) % 65521; }
  return (b << 16) | a;
}

uint32_t fnv1a32(const uint8_t *p, size_t n) {
  uint32_t h = 2166136261u;
  while (n--) { h ^= *p++; h *= 16777619u; }
  return h;
}

uint16_t fletcher16(const uint8_t *p, size_t n) {
  uint16_t s1 = 0, s2 = 0;
  while (n--) { s1 = (s1 + *p++) % 255; s2 = (s2 + s1) % 255; }
  return (uint16_t)(s2 << 8 | s1);
}

size_t base64_encode(const uint8_t *in, size_t n, char *out) {
  static const char t[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
  size_t k = 0;
  for (size_t i = 0; i < n; i += 3) {
    uint32_t v = in[i] << 16 | (i + 1 < n ? in[i + 1] << 8 : 0) | (i + 2 < n ? in[i + 2] : 0);
    out[k++] = t[v >> 18 & 63]; out[k++] = t[v >> 12 & 63];
    out[k++] = i + 1 < n ? t[v >> 6 & 63] : '=';
    out[k++] = i + 2 < n ? t[v & 63] : '=';
  }
  out[k] = 0;
  return k;
}

static int b64_value(char c) {
  if (c >= 'A' && c <= 'Z') return c - 'A';
  if (c >= 'a' && c <= 'z') return c - 'a' + 26;
  if (c >= '0' && c <= '9') return c - '0' + 52;
  return c == '+' ? 62 : c == '/' ? 63 : -1;
}

long base64_decode(const char *in, uint8_t *out) {
  long k = 0; uint32_t acc = 0; int bits = 0;
  for (; *in && *in != '='; in++) {
    int v = b64_value(*in);
    if (v < 0) return -1;
    acc = acc << 6 | v; bits += 6;
    if (bits >= 8) { bits -= 8; out[k++] = (uint8_t)(acc >> bits); }
  }
  return k;
}

size_t rle_encode(const uint8_t *in, size_t n, uint8_t *out) {
  size_t k = 0;
  for (size_t i = 0; i < n;) {
    size_t run = 1;
    while (i + run < n && in[i + run] == in[i] && run < 255) run++;
    out[k++] = (uint8_t)run; out[k++] = in[i];
    i += run;
  }
  return k;
}

size_t rle_decode(const uint8_t *in, size_t n, uint8_t *out) {
  size_t k = 0;
  for (size_t i = 0; i + 1 < n; i += 2) for (int r = 0; r < in[i]; r++) out[k++] = in[i + 1];
  return k;
}

size_t hex_encode(const uint8_t *in, size_t n, char *out) {
  static const char d[] = "0123456789ABCDEF";
  for (size_t i = 0; i < n; i++) { out[2 * i] = d[in[i] >> 4]; out[2 * i + 1] = d[in[i] & 15]; }
  out[2 * n] = 0;
  return 2 * n;
}

size_t varint_encode(uint64_t v, uint8_t *out) {
  size_t k = 0;
  while (v >= 0x80) { out[k++] = (uint8_t)(v | 0x80); v >>= 7; }
  out[k++] = (uint8_t)v;
  return k;
}

uint64_t varint_decode(const uint8_t *in, size_t *used) {
  uint64_t v = 0; int shift = 0; size_t k = 0;
  do { v |= (uint64_t)(in[k] & 0x7f) << shift; shift += 7; } while (in[k++] & 0x80 && shift < 64);
  *used = k;
  return v;
}

uint32_t zigzag_encode(int32_t v) { return ((uint32_t)v << 1) ^ (uint32_t)(v >> 31); }

int32_t zigzag_decode(uint32_t v) { return (int32_t)(v >> 1) ^ -(int32_t)(v & 1); }

void xor_cipher(uint8_t *p, size_t n, const uint8_t *key, size_t klen) {
  for (size_t i = 0; i < n; i++) p[i] ^= key[i % klen];
}

int utf8_decode(const uint8_t *s, uint32_t *cp) {
  if (s[0] < 0x80) { *cp = s[0]; return 1; }
  if ((s[0] & 0xe0) == 0xc0) { *cp = (s[0] & 0x1f) << 6 | (s[1] & 0x3f); return 2; }
  if ((s[0] & 0xf0) == 0xe0) { *cp = (s[0] & 0x0f) << 12 | (s[1] & 0x3f) << 6 | (s[2] & 0x3f); return 3; }
  *cp = (s[0] & 0x07) << 18 | (s[1] & 0x3f) << 12 | (s[2] & 0x3f) << 6 | (s[3] & 0x3f);
  return 4;
}

int utf8_encode(uint32_t cp, uint8_t *out) {
  if (cp < 0x80) { out[0] = (uint8_t)cp; return 1; }
  if (cp < 0x800) { out[0] = 0xc0 | cp >> 6; out[1] = 0x80 | (cp & 0x3f); return 2; }
  if (cp < 0x10000) {
    out[0] = 0xe0 | cp >> 12; out[1] = 0x80 | (cp >> 6 & 0x3f); out[2] = 0x80 | (cp & 0x3f);
    return 3;
  }
  out[0] = 0xf0 | cp >> 18; out[1] = 0x80 | (cp >> 12 & 0x3f);
  out[2] = 0x80 | (cp >> 6 & 0x3f); out[3] = 0x80 | (cp & 0x3f);
  return 4;
}

uint32_t murmur_mix(uint32_t h) {
  h ^= h >> 16; h *= 0x85ebca6bu; h ^= h >> 13; h *= 0xc2b2ae35u; h ^= h >> 16;
  return h;
}

uint16_t crc16_ccitt(const uint8_t *p, size_t n) {
  uint16_t c = 0xffff;
  while (n--) {
    c ^= (uint16_t)(*p++) << 8;
    for (int k = 0; k < 8; k++) c = c & 0x8000 ? (uint16_t)(c << 1) ^ 0x1021 : (uint16_t)(c << 1);
  }
  return c;
}

void bytes_swap32(uint32_t *v, size_t n) {
  for (size_t i = 0; i < n; i++) {
    uint32_t x = v[i];
    v[i] = x >> 24 | (x >> 8 & 0xff00) | (x << 8 & 0xff0000) | x << 24;
  }
}

int luhn_valid(const char *digits) {
  int sum = 0, dbl = 0;
  const char *end = digits;
  while (*end) end++;
  while (end-- > digits) {
    int d = *end - '0';
    if (d < 0 || d > 9) return 0;
    if (dbl) { d *= 2; if (d > 9) d -= 9; }
    sum += d; dbl = !dbl;
  }
  return sum % 10 == 0;
}

unsigned parity_bytes(const uint8_t *p, size_t n) {
  uint8_t x = 0;
  while (n--) x ^= *p++;
  x ^= x >> 4; x ^= x >> 2; x ^= x >> 1;
  return x & 1;
}

size_t bit_pack4(const uint8_t *nibbles, size_t n, uint8_t *out) {
  size_t k = 0;
  for (size_t i = 0; i < n; i += 2) out[k++] = (uint8_t)(nibbles[i] << 4 | (i + 1 < n ? nibbles[i + 1] & 15 : 0));
  return k;
}
