// Shared by every kernel source: the ABI version the loader checks after dlopen (cbuild.ABI_VERSION, bumped
// together with it whenever an entry point's signature or meaning changes) and the status codes the entry points
// return (cbuild.kernel_error turns them into Python exceptions).
#pragma once

#define PAGEDLM_ABI_VERSION 4

enum PagedlmStatus {
  PAGEDLM_OK = 0,
  PAGEDLM_UNSUPPORTED = -1,  // a head_dim, dtype or layout the kernel does not handle
  PAGEDLM_BAD_BATCH = -2,    // query_start_loc / seq_lens / block-table width inconsistent
  PAGEDLM_BAD_BLOCK = -3,    // a block id the kernel would read is outside [0, num_blocks)
  PAGEDLM_BAD_SLOT = -4,     // a slot the kernel would write is outside [0, num_blocks * block_size)
};

extern "C" int pagedlm_abi_version() { return PAGEDLM_ABI_VERSION; }
