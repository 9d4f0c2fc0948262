/* AMX plumbing of the kernels that use tiles: the tile configuration's memory layout and Linux's
 * permission for the tile state. Include only under __AMX_TILE__ && __AMX_BF16__. */
#ifndef MOEBUS_AMX_COMMON_H
#define MOEBUS_AMX_COMMON_H

#include <stdint.h>
#include <sys/syscall.h>
#include <unistd.h>

/* What ldtilecfg reads (palette 1): bytes per row and rows of each of the 16 tiles. */
typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} __attribute__((packed, aligned(64))) tilecfg_t;

/* Linux hands out the AMX tile state only on request (once a process; torch's oneDNN asks too). */
static int amx_permitted(void) {
    static int ok = -1;
    if (ok < 0) ok = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
    return ok;
}

#endif
