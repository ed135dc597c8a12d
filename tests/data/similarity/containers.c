/* Small data-structure routines for the similarity benchmark's test (tests/test_similarity.py). */
#include <stddef.h>
#include <stdlib.h>
#include <string.h>

struct node { int value; struct node *next; };
struct tree { int key; struct tree *left, *right; };
struct vec { int *data; size_t len, cap; };
struct ring { int buf[64]; unsigned head, tail; };
struct heap { int v[256]; int n; };

struct node *list_push(struct node *head, int value) {
  struct node *n = malloc(sizeof *n);
  if (!n) return head;
  n->value = value; n->next = head;
  return n;
}

struct node *list_reverse(struct node *head) {
  struct node *prev = 0;
  while (head) { struct node *next = head->next; head->next = prev; prev = head; head = next; }
  return prev;
}

size_t list_length(const struct node *n) { size_t k = 0; for (; n; n = n->next) k++; return k; }

void list_free(struct node *n) { while (n) { struct node *next = n->next; free(n); n = next; } }

struct node *list_find(struct node *n, int value) {
  for (; n; n = n->next) if (n->value == value) return n;
  return 0;
}

struct node *list_merge_sorted(struct node *a, struct node *b) {
  struct node head, *t = &head;
  while (a && b) {
    if (a->value <= b->value) { t->next = a; a = a->next; } else { t->next = b; b = b->next; }
    t = t->next;
  }
  t->next = a ? a : b;
  return head.next;
}

struct tree *tree_insert(struct tree *t, int key) {
  if (!t) {
    t = calloc(1, sizeof *t);
    if (t) t->key = key;
    return t;
  }
  if (key < t->key) t->left = tree_insert(t->left, key);
  else if (key > t->key) t->right = tree_insert(t->right, key);
  return t;
}

int tree_contains(const struct tree *t, int key) {
  while (t) { if (key == t->key) return 1; t = key < t->key ? t->left : t->right; }
  return 0;
}

int tree_height(const struct tree *t) {
  if (!t) return 0;
  int l = tree_height(t->left), r = tree_height(t->right);
  return 1 + (l > r ? l : r);
}

int tree_sum(const struct tree *t) { return t ? t->key + tree_sum(t->left) + tree_sum(t->right) : 0; }

void tree_free(struct tree *t) { if (t) { tree_free(t->left); tree_free(t->right); free(t); } }

int vec_push(struct vec *v, int x) {
  if (v->len == v->cap) {
    size_t cap = v->cap ? v->cap * 2 : 8;
    int *d = realloc(v->data, cap * sizeof *d);
    if (!d) return -1;
    v->data = d; v->cap = cap;
  }
  v->data[v->len++] = x;
  return 0;
}

int vec_pop(struct vec *v, int *out) {
  if (!v->len) return 0;
  *out = v->data[--v->len];
  return 1;
}

void vec_remove_at(struct vec *v, size_t i) {
  if (i >= v->len) return;
  memmove(v->data + i, v->data + i + 1, (v->len - i - 1) * sizeof *v->data);
  v->len--;
}

int ring_put(struct ring *r, int x) {
  if (r->head - r->tail == 64) return 0;
  r->buf[r->head++ & 63] = x;
  return 1;
}

int ring_get(struct ring *r, int *x) {
  if (r->head == r->tail) return 0;
  *x = r->buf[r->tail++ & 63];
  return 1;
}

void heap_push(struct heap *h, int x) {
  int i = h->n++;
  while (i > 0 && h->v[(i - 1) / 2] > x) { h->v[i] = h->v[(i - 1) / 2]; i = (i - 1) / 2; }
  h->v[i] = x;
}

int heap_pop(struct heap *h) {
  int top = h->v[0], x = h->v[--h->n], i = 0;
  for (;;) {
    int c = 2 * i + 1;
    if (c >= h->n) break;
    if (c + 1 < h->n && h->v[c + 1] < h->v[c]) c++;
    if (h->v[c] >= x) break;
    h->v[i] = h->v[c]; i = c;
  }
  h->v[i] = x;
  return top;
}

void insertion_sort(int *a, int n) {
  for (int i = 1; i < n; i++) {
    int x = a[i], j = i - 1;
    while (j >= 0 && a[j] > x) { a[j + 1] = a[j]; j--; }
    a[j + 1] = x;
  }
}

void quick_sort(int *a, int lo, int hi) {
  while (lo < hi) {
    int p = a[(lo + hi) / 2], i = lo, j = hi;
    while (i <= j) {
      while (a[i] < p) i++;
      while (a[j] > p) j--;
      if (i <= j) { int t = a[i]; a[i] = a[j]; a[j] = t; i++; j--; }
    }
    if (j - lo < hi - i) { quick_sort(a, lo, j); lo = i; } else { quick_sort(a, i, hi); hi = j; }
  }
}

int binary_search(const int *a, int n, int key) {
  int lo = 0, hi = n - 1;
  while (lo <= hi) {
    int mid = lo + (hi - lo) / 2;
    if (a[mid] == key) return mid;
    if (a[mid] < key) lo = mid + 1; else hi = mid - 1;
  }
  return -1;
}

void merge_sorted_arrays(const int *a, int na, const int *b, int nb, int *out) {
  int i = 0, j = 0, k = 0;
  while (i < na && j < nb) out[k++] = a[i] <= b[j] ? a[i++] : b[j++];
  while (i < na) out[k++] = a[i++];
  while (j < nb) out[k++] = b[j++];
}

int dedup_sorted(int *a, int n) {
  int k = 0;
  for (int i = 0; i < n; i++) if (k == 0 || a[k - 1] != a[i]) a[k++] = a[i];
  return k;
}

void rotate_left(int *a, int n, int k) {
  if (n <= 0) return;
  k %= n;
  for (int c = 0; c < k; c++) { int first = a[0]; memmove(a, a + 1, (n - 1) * sizeof *a); a[n - 1] = first; }
}

int array_max_index(const int *a, int n) {
  int best = 0;
  for (int i = 1; i < n; i++) if (a[i] > a[best]) best = i;
  return best;
}

void counting_sort_bytes(unsigned char *a, int n) {
  int count[256] = {0};
  for (int i = 0; i < n; i++) count[a[i]]++;
  for (int v = 0, k = 0; v < 256; v++) while (count[v]--) a[k++] = (unsigned char)v;
}

int union_find_root(int *parent, int x) {
  while (parent[x] != x) { parent[x] = parent[parent[x]]; x = parent[x]; }
  return x;
}

void union_find_join(int *parent, int *rank, int a, int b) {
  a = union_find_root(parent, a); b = union_find_root(parent, b);
  if (a == b) return;
  if (rank[a] < rank[b]) { int t = a; a = b; b = t; }
  parent[b] = a;
  if (rank[a] == rank[b]) rank[a]++;
}
