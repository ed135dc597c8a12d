/* Small string routines for the similarity benchmark's test (tests/test_similarity.py). */
#include <stddef.h>

size_t str_length(const char *s) { size_t n = 0; while (s[n]) n++; return n; }

int str_compare(const char *a, const char *b) {
  while (*a && *a == *b) { a++; b++; }
  return (unsigned char)*a - (unsigned char)*b;
}

char *str_copy_bounded(char *dst, const char *src, size_t cap) {
  size_t i = 0;
  if (cap == 0) return dst;
  for (; i + 1 < cap && src[i]; i++) dst[i] = src[i];
  dst[i] = 0;
  return dst;
}

void str_reverse(char *s) {
  size_t n = str_length(s);
  for (size_t i = 0; i < n / 2; i++) { char t = s[i]; s[i] = s[n - 1 - i]; s[n - 1 - i] = t; }
}

int str_to_int(const char *s) {
  int sign = 1, v = 0;
  while (*s == ' ' || *s == '\t') s++;
  if (*s == '-') { sign = -1; s++; } else if (*s == '+') s++;
  while (*s >= '0' && *s <= '9') v = v * 10 + (*s++ - '0');
  return sign * v;
}

int int_to_str(int v, char *out) {
  char tmp[16]; int n = 0, neg = v < 0, k = 0;
  unsigned u = neg ? -(unsigned)v : (unsigned)v;
  do { tmp[n++] = '0' + u % 10; u /= 10; } while (u);
  if (neg) out[k++] = '-';
  while (n) out[k++] = tmp[--n];
  out[k] = 0;
  return k;
}

int count_char(const char *s, char c) { int n = 0; for (; *s; s++) n += *s == c; return n; }

void to_upper(char *s) { for (; *s; s++) if (*s >= 'a' && *s <= 'z') *s -= 32; }

void to_lower(char *s) { for (; *s; s++) if (*s >= 'A' && *s <= 'Z') *s += 32; }

const char *find_substring(const char *hay, const char *needle) {
  if (!*needle) return hay;
  for (; *hay; hay++) {
    const char *h = hay, *n = needle;
    while (*h && *n && *h == *n) { h++; n++; }
    if (!*n) return hay;
  }
  return 0;
}

int is_palindrome(const char *s) {
  size_t i = 0, j = str_length(s);
  while (i + 1 < j) { if (s[i] != s[j - 1]) return 0; i++; j--; }
  return 1;
}

size_t trim_spaces(char *s) {
  size_t start = 0, end = str_length(s), k = 0;
  while (start < end && (s[start] == ' ' || s[start] == '\n')) start++;
  while (end > start && (s[end - 1] == ' ' || s[end - 1] == '\n')) end--;
  for (size_t i = start; i < end; i++) s[k++] = s[i];
  s[k] = 0;
  return k;
}

int count_words(const char *s) {
  int words = 0, in = 0;
  for (; *s; s++) {
    int sp = *s == ' ' || *s == '\t' || *s == '\n';
    if (!sp && !in) words++;
    in = !sp;
  }
  return words;
}

unsigned hex_to_uint(const char *s) {
  unsigned v = 0;
  for (;; s++) {
    int d;
    if (*s >= '0' && *s <= '9') d = *s - '0';
    else if (*s >= 'a' && *s <= 'f') d = *s - 'a' + 10;
    else if (*s >= 'A' && *s <= 'F') d = *s - 'A' + 10;
    else return v;
    v = v * 16 + d;
  }
}

void uint_to_hex(unsigned v, char out[9]) {
  static const char digits[] = "0123456789abcdef";
  for (int i = 7; i >= 0; i--) { out[i] = digits[v & 15]; v >>= 4; }
  out[8] = 0;
}

int levenshtein_small(const char *a, const char *b) {
  int prev[33], cur[33];
  int la = (int)str_length(a), lb = (int)str_length(b);
  if (la > 32 || lb > 32) return -1;
  for (int j = 0; j <= lb; j++) prev[j] = j;
  for (int i = 1; i <= la; i++) {
    cur[0] = i;
    for (int j = 1; j <= lb; j++) {
      int c = prev[j - 1] + (a[i - 1] != b[j - 1]);
      if (prev[j] + 1 < c) c = prev[j] + 1;
      if (cur[j - 1] + 1 < c) c = cur[j - 1] + 1;
      cur[j] = c;
    }
    for (int j = 0; j <= lb; j++) prev[j] = cur[j];
  }
  return prev[lb];
}

int starts_with(const char *s, const char *prefix) {
  while (*prefix) if (*s++ != *prefix++) return 0;
  return 1;
}

int ends_with(const char *s, const char *suffix) {
  size_t n = str_length(s), m = str_length(suffix);
  if (m > n) return 0;
  return str_compare(s + n - m, suffix) == 0;
}

void caesar_shift(char *s, int k) {
  k = ((k % 26) + 26) % 26;
  for (; *s; s++) {
    if (*s >= 'a' && *s <= 'z') *s = 'a' + (*s - 'a' + k) % 26;
    else if (*s >= 'A' && *s <= 'Z') *s = 'A' + (*s - 'A' + k) % 26;
  }
}

size_t replace_char(char *s, char from, char to) {
  size_t n = 0;
  for (; *s; s++) if (*s == from) { *s = to; n++; }
  return n;
}

int longest_run(const char *s) {
  int best = 0, run = 0; char last = 0;
  for (; *s; s++) { run = *s == last ? run + 1 : 1; last = *s; if (run > best) best = run; }
  return best;
}

size_t squeeze_spaces(char *s) {
  size_t k = 0; int space = 0;
  for (size_t i = 0; s[i]; i++) {
    if (s[i] == ' ') { if (!space) s[k++] = ' '; space = 1; }
    else { s[k++] = s[i]; space = 0; }
  }
  s[k] = 0;
  return k;
}

unsigned string_hash_djb2(const char *s) {
  unsigned h = 5381;
  while (*s) h = h * 33 + (unsigned char)*s++;
  return h;
}

int split_fields(char *line, char sep, char **fields, int max) {
  int n = 0;
  if (max <= 0) return 0;
  fields[n++] = line;
  for (; *line && n < max; line++)
    if (*line == sep) { *line = 0; fields[n++] = line + 1; }
  return n;
}

int vowel_count(const char *s) {
  int n = 0;
  for (; *s; s++) switch (*s | 32) { case 'a': case 'e': case 'i': case 'o': case 'u': n++; }
  return n;
}

int parse_key_value(const char *line, char *key, int kcap, char *val, int vcap) {
  int k = 0, v = 0;
  while (*line && *line != '=' && k + 1 < kcap) key[k++] = *line++;
  key[k] = 0;
  if (*line != '=') return 0;
  line++;
  while (*line && *line != '\n' && v + 1 < vcap) val[v++] = *line++;
  val[v] = 0;
  return 1;
}
