/* Kernel selection by CPU features and the threaded driver that runs one job. */
#ifndef MEMSNAP_RS_H
#define MEMSNAP_RS_H

#include "kernels.h"

enum { RS_ISA_SCALAR, RS_ISA_SSSE3, RS_ISA_AVX2, RS_ISA_COUNT };

extern const char *const rs_isa_names[RS_ISA_COUNT];

void rs_init(void);
int rs_isa_available(int isa);
int rs_isa(void);
int rs_set_isa(int isa);                /* 0, or -1 if this CPU lacks it */
/* Fills the structure flags of a job from its coefficients. */
void rs_job_classify(rs_job *job);
/* Runs the job over [0, len) on up to `threads` threads (the caller is one of them). */
int rs_run(const rs_job *job, size_t len, int threads);

#endif
