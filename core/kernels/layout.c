/* The layout of every struct the Python side passes (qp_abi.h) as this compiler lays it out:
 * each field's offset and size, and each struct's size (field ""). native.py compares its ctypes
 * Structures with this table when it loads the library (a mismatch refuses the library), and
 * tests/kernels/test_layout.py checks both sides field by field. Self-contained: the test also
 * compiles it alone as a probe of qp_types.h and qp_abi.h. */
#include <stddef.h>
#include <stdint.h>
#include "qp_types.h"

typedef struct {
    const char *type, *field;   /* field "": the struct itself */
    int64_t offset, size;
} qp_layout_entry;

#define QP_STRUCT(T) {#T, "", 0, (int64_t)sizeof(T)},
#define QP_FIELD(T, F) {#T, #F, (int64_t)offsetof(T, F), (int64_t)sizeof(((T *)0)->F)},

/* every struct and field of qp_abi.h (its X-macro, generated from abi.py) */
static const qp_layout_entry QP_LAYOUT[] = {
    QP_ABI_LAYOUT(QP_STRUCT, QP_FIELD)
};
#undef QP_STRUCT
#undef QP_FIELD

/* the table and its length (*n) */
const qp_layout_entry *qp_layout_table(int64_t *n) {
    *n = (int64_t)(sizeof QP_LAYOUT / sizeof QP_LAYOUT[0]);
    return QP_LAYOUT;
}
