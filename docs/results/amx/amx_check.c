/* Does AMX work on this machine at all? Requests the tile-data permission, loads a tile config, runs one
   int8 tile dot product. gcc -O2 -mamx-tile -mamx-int8 amx_check.c -o amx_check && ./amx_check
   On the KVM Xeon of 2026-12-02 it prints "dpbssd ok: 128": AMX itself works there. */
#include <stdio.h>
#include <string.h>
#include <stdint.h>
#include <unistd.h>
#include <sys/syscall.h>
#include <immintrin.h>
#define ARCH_GET_XCOMP_PERM 0x1022
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18
typedef struct { uint8_t palette_id; uint8_t start_row; uint8_t reserved[14]; uint16_t colsb[16]; uint8_t rows[16]; } __attribute__((packed)) cfg_t;
int main(){
  long r = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA);
  unsigned long bm=0; syscall(SYS_arch_prctl, ARCH_GET_XCOMP_PERM, &bm);
  printf("req=%ld perm=0x%lx\n", r, bm); fflush(stdout);
  cfg_t c __attribute__((aligned(64))); memset(&c,0,sizeof c); c.palette_id=1;
  for(int i=0;i<3;i++){c.rows[i]=16;c.colsb[i]=64;}
  _tile_loadconfig(&c); printf("ldtilecfg ok\n"); fflush(stdout);
  static int8_t a[16*64], b[16*64]; static int32_t cc[16*16];
  for(int i=0;i<16*64;i++){a[i]=1;b[i]=2;}
  _tile_zero(0); _tile_loadd(1,a,64); _tile_loadd(2,b,64); _tile_dpbssd(0,1,2); _tile_stored(0,cc,64); _tile_release();
  printf("dpbssd ok: %d (expect 128)\n", cc[0]); return 0; }
