/* The part of libucp's ABI (UCX 1.x) the core calls, declared here rather
 * than taken from UCX's headers: the build then needs nothing but a C
 * compiler and Python's headers (UCX's headers come only in the 140 MB
 * libucx wheel, which a build requirement would fetch into every isolated
 * build).  The library itself is the copy ucxx loaded, opened at run time
 * (ucp.c).  tests/core/test_ucp_abi.py compiles these declarations beside
 * UCX's own ucp.h, where the libucx wheel is installed, and compares every
 * offset, size and constant: a UCX whose ABI moved fails there, not on the
 * wire. */
#ifndef UCXRPC_UCP_ABI_H
#define UCXRPC_UCP_ABI_H

#include <stddef.h>
#include <stdint.h>

typedef void *abi_ucp_worker_h;
typedef void *abi_ucp_ep_h;
typedef void *abi_ucp_tag_message_h;
typedef void *abi_ucs_status_ptr_t;
typedef int abi_ucs_status_t; /* ucs_status_t: an int-sized enum */

/* ucp_request_param_t */
typedef struct {
    uint32_t op_attr_mask;
    uint32_t flags;
    void *request;
    void *cb;           /* a union of callback pointers */
    uint64_t datatype;  /* ucp_datatype_t */
    void *user_data;
    void *reply_buffer;
    int memory_type;    /* ucs_memory_type_t */
    void *recv_info;    /* a union of pointers */
    void *memh;
} abi_request_param_t;

/* ucp_tag_recv_info_t */
typedef struct {
    uint64_t sender_tag;
    size_t length;
} abi_tag_recv_info_t;

/* ucp_dt_iov_t */
typedef struct {
    void *buffer;
    size_t length;
} abi_dt_iov_t;

#define ABI_UCS_OK 0
#define ABI_UCS_INPROGRESS 1
#define ABI_UCS_ERR_LAST (-100)
#define ABI_OP_ATTR_FIELD_DATATYPE (1u << 3)
#define ABI_OP_ATTR_FIELD_MEMORY_TYPE (1u << 6)
#define ABI_MEMORY_TYPE_HOST 0
#define ABI_MEMORY_TYPE_CUDA 1
#define ABI_DATATYPE_IOV 2 /* ucp_dt_make_iov() */

/* UCS_PTR_IS_ERR / UCS_PTR_STATUS: an error travels as a pointer value
 * within the last 100 of the address space. */
static inline int abi_ptr_is_err(abi_ucs_status_ptr_t p) {
    return (uintptr_t)p >= (uintptr_t)(intptr_t)ABI_UCS_ERR_LAST;
}
static inline abi_ucs_status_t abi_ptr_status(abi_ucs_status_ptr_t p) {
    return (abi_ucs_status_t)(intptr_t)p;
}

#endif
