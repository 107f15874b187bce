/* The client end of attnd's UCX data plane as a C ABI (libattnd_plane.so), for clients in other
 * languages: the Python client binds it with ctypes (client/python/attnd/data_plane.py). The
 * handshake (ConnectDataPlane) is the caller's, over its own gRPC channel; this library moves the
 * bytes. docs/data-plane.md. Errors: a nonzero return and a message in err (errlen bytes). */
#ifndef ATTND_TRANSPORT_PLANE_C_API_H_
#define ATTND_TRANSPORT_PLANE_C_API_H_

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct attnd_plane attnd_plane;
typedef struct attnd_plane_send attnd_plane_send;

/* A worker and an output region of output_bytes; NULL on failure (err says why). */
attnd_plane* attnd_plane_create(int64_t output_bytes, char* err, size_t errlen);
/* The same, for a server on this host when local is nonzero: this end's UCX then listens on the
 * loopback interfaces only (unless UCX_NET_DEVICES says otherwise). */
attnd_plane* attnd_plane_create_for(int64_t output_bytes, int local, char* err, size_t errlen);
void attnd_plane_destroy(attnd_plane* p);
/* This end's UCX worker address (*len bytes at *address, valid while p is), for the
 * handshake's worker_address: a server given it sends outputs unasked. */
void attnd_plane_address(attnd_plane* p, const char** address, size_t* len);
/* The handshake's reply (a server that pushes no outputs). */
int attnd_plane_attach(attnd_plane* p, uint64_t plane_id, const char* token, size_t token_len,
                       const char* server_address, size_t address_len, int64_t input_bytes,
                       char* err, size_t errlen);
/* The same, with the reply's pushes_outputs: nonzero, outputs are awaited, not pulled, and only
 * those announced by attnd_plane_want are taken. */
int attnd_plane_attach_with(attnd_plane* p, uint64_t plane_id, const char* token, size_t token_len,
                            const char* server_address, size_t address_len, int64_t input_bytes,
                            int pushes_outputs, char* err, size_t errlen);
/* After attaching: says to the server every period_ms (the reply's keepalive_ms, when the request
 * offered sends_keepalives) that this end lives. */
void attnd_plane_keepalive(attnd_plane* p, int64_t period_ms);
/* 1 once this end's endpoint to the server failed (the server's worker went, or the network to
 * it): the plane carries nothing more; 0 while it may. */
int attnd_plane_lost(attnd_plane* p);
/* Space in the server's input region / the output region for one call: an offset, or -1 when
 * it does not fit now. */
int64_t attnd_plane_take_input(attnd_plane* p, int64_t bytes);
void attnd_plane_give_input(attnd_plane* p, int64_t offset);
int64_t attnd_plane_take_output(attnd_plane* p, int64_t bytes);
void attnd_plane_give_output(attnd_plane* p, int64_t offset);
uint64_t attnd_plane_next_transfer(attnd_plane* p);
/* Output `transfer` is asked for by a call about to be sent (before the call: a server that
 * pushes may send it before the reply). */
void attnd_plane_want(attnd_plane* p, uint64_t transfer);
/* Sends n pieces back to back into the input region from offset on, as one transfer; the pieces
 * stay valid until attnd_plane_wait, which every send must get (it frees the handle). */
attnd_plane_send* attnd_plane_put(attnd_plane* p, const void* const* pieces, const size_t* lengths,
                                  size_t n, int64_t offset, uint64_t transfer);
int attnd_plane_wait(attnd_plane_send* s, double timeout_s, char* err, size_t errlen);
/* Waits for output `transfer` ([offset, +n) of the output region); *where is its bytes. */
int attnd_plane_await(attnd_plane* p, uint64_t transfer, int64_t offset, size_t n, double timeout_s,
                      const char** where, char* err, size_t errlen);
void attnd_plane_forget(attnd_plane* p, uint64_t transfer);

#ifdef __cplusplus
}
#endif

#endif  // ATTND_TRANSPORT_PLANE_C_API_H_
