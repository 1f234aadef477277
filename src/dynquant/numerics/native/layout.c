/* The descriptors' layouts as this build compiled them, for the Python mirror's test
 * (native/interface.py): every struct's size and every field's offset by name. */
#include <string.h>

#include "kernels.h"

typedef struct {
    const char *type, *field;
    int64_t offset;
} dq_field_row;

#define DQ_FIELD_ROW(S, f, off) {#S, #f, (int64_t)offsetof(S, f)},
#define DQ_SIZE_ROW(S, size) {#S, "", (int64_t)sizeof(S)},
static const dq_field_row ROWS[] = {
    DQ_DESCRIPTORS(DQ_SIZE_ROW) DQ_PACKED_BLOCK_FIELDS(DQ_FIELD_ROW)
    DQ_EXPERT_PAIRS_FIELDS(DQ_FIELD_ROW) DQ_PRODUCT_FIELDS(DQ_FIELD_ROW)
    DQ_DECODE_LAYER_FIELDS(DQ_FIELD_ROW) DQ_DECODE_PROGRAM_FIELDS(DQ_FIELD_ROW)};

int64_t dq_layout(const char *type, const char *field) {
    if (!field) field = "";
    for (size_t i = 0; i < sizeof ROWS / sizeof ROWS[0]; i++)
        if (!strcmp(ROWS[i].type, type) && !strcmp(ROWS[i].field, field)) return ROWS[i].offset;
    return -1;
}

int64_t dq_layout_fields(const char *type) {
    int64_t count = -1; /* its size's row is not a field */
    for (size_t i = 0; i < sizeof ROWS / sizeof ROWS[0]; i++) count += !strcmp(ROWS[i].type, type);
    return count;
}
