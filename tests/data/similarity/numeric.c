/* Small numeric routines for the similarity benchmark's test (tests/test_similarity.py). */
#include <stdint.h>

long gcd(long a, long b) { while (b) { long t = a % b; a = b; b = t; } return a < 0 ? -a : a; }

long lcm(long a, long b) { long g = gcd(a, b); return g ? a / g * b : 0; }

int is_prime(unsigned n) {
  if (n < 2) return 0;
  if (n % 2 == 0) return n == 2;
  for (unsigned d = 3; d * d <= n; d += 2) if (n % d == 0) return 0;
  return 1;
}

uint64_t power_mod(uint64_t b, uint64_t e, uint64_t m) {
  uint64_t r = 1 % m;
  b %= m;
  while (e) { if (e & 1) r = (r * b) % m; b = (b * b) % m; e >>= 1; }
  return r;
}

unsigned isqrt(unsigned n) {
  unsigned x = n, y = (x + 1) / 2;
  while (y < x) { x = y; y = (x + n / x) / 2; }
  return x;
}

uint64_t fibonacci(unsigned n) {
  uint64_t a = 0, b = 1;
  for (unsigned i = 0; i < n; i++) { uint64_t t = a + b; a = b; b = t; }
  return a;
}

uint64_t factorial(unsigned n) { uint64_t r = 1; while (n > 1) r *= n--; return r; }

int popcount32(uint32_t x) {
  x = x - ((x >> 1) & 0x55555555u);
  x = (x & 0x33333333u) + ((x >> 2) & 0x33333333u);
  return (int)((((x + (x >> 4)) & 0x0f0f0f0fu) * 0x01010101u) >> 24);
}

uint32_t reverse_bits(uint32_t x) {
  uint32_t r = 0;
  for (int i = 0; i < 32; i++) { r = (r << 1) | (x & 1); x >>= 1; }
  return r;
}

int leading_zeros(uint32_t x) {
  int n = 0;
  if (!x) return 32;
  while (!(x & 0x80000000u)) { x <<= 1; n++; }
  return n;
}

double mean(const double *v, int n) {
  double s = 0;
  for (int i = 0; i < n; i++) s += v[i];
  return n ? s / n : 0;
}

double variance(const double *v, int n) {
  double m = mean(v, n), s = 0;
  for (int i = 0; i < n; i++) s += (v[i] - m) * (v[i] - m);
  return n > 1 ? s / (n - 1) : 0;
}

double dot_product(const double *a, const double *b, int n) {
  double s = 0;
  for (int i = 0; i < n; i++) s += a[i] * b[i];
  return s;
}

void matrix_multiply(const double *a, const double *b, double *c, int n) {
  for (int i = 0; i < n; i++)
    for (int j = 0; j < n; j++) {
      double s = 0;
      for (int k = 0; k < n; k++) s += a[i * n + k] * b[k * n + j];
      c[i * n + j] = s;
    }
}

void matrix_transpose(double *m, int n) {
  for (int i = 0; i < n; i++)
    for (int j = i + 1; j < n; j++) { double t = m[i * n + j]; m[i * n + j] = m[j * n + i]; m[j * n + i] = t; }
}

double polynomial_eval(const double *coef, int degree, double x) {
  double r = coef[degree];
  for (int i = degree - 1; i >= 0; i--) r = r * x + coef[i];
  return r;
}

double newton_sqrt(double x) {
  if (x <= 0) return 0;
  double g = x > 1 ? x / 2 : 1;
  for (int i = 0; i < 40; i++) g = 0.5 * (g + x / g);
  return g;
}

int clamp_int(int v, int lo, int hi) { return v < lo ? lo : v > hi ? hi : v; }

int max_subarray(const int *v, int n) {
  int best = v[0], cur = v[0];
  for (int i = 1; i < n; i++) {
    cur = cur + v[i] > v[i] ? cur + v[i] : v[i];
    if (cur > best) best = cur;
  }
  return best;
}

void prefix_sums(const int *v, long *out, int n) {
  long s = 0;
  for (int i = 0; i < n; i++) { s += v[i]; out[i] = s; }
}

int sieve_count(unsigned char *mark, int n) {
  int count = 0;
  for (int i = 0; i <= n; i++) mark[i] = 1;
  for (int i = 2; i <= n; i++) {
    if (!mark[i]) continue;
    count++;
    for (long j = (long)i * i; j <= n; j += i) mark[j] = 0;
  }
  return count;
}

uint32_t xorshift32(uint32_t *state) {
  uint32_t x = *state;
  x ^= x << 13; x ^= x >> 17; x ^= x << 5;
  return *state = x;
}

uint64_t lcg_next(uint64_t *state) {
  *state = *state * 6364136223846793005ull + 1442695040888963407ull;
  return *state >> 33;
}

int digit_sum(long v) {
  int s = 0;
  if (v < 0) v = -v;
  while (v) { s += v % 10; v /= 10; }
  return s;
}

long reverse_digits(long v) {
  long r = 0;
  while (v) { r = r * 10 + v % 10; v /= 10; }
  return r;
}

double trapezoid_integral(const double *y, int n, double dx) {
  double s = 0;
  for (int i = 1; i < n; i++) s += 0.5 * (y[i - 1] + y[i]) * dx;
  return s;
}

int collatz_steps(uint64_t n) {
  int steps = 0;
  while (n > 1) { n = n & 1 ? 3 * n + 1 : n / 2; steps++; }
  return steps;
}

int binomial_row(uint64_t *row, int n) {
  row[0] = 1;
  for (int i = 1; i <= n; i++) {
    row[i] = 1;
    for (int j = i - 1; j > 0; j--) row[j] += row[j - 1];
  }
  return n + 1;
}

float fast_inverse_sqrt(float x) {
  union { float f; uint32_t i; } u = {x};
  u.i = 0x5f3759df - (u.i >> 1);
  return u.f * (1.5f - 0.5f * x * u.f * u.f);
}
