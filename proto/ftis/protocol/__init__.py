"""Wire-level building blocks shared by coordinator and client: identities, signed
envelopes, stable error codes and bundle helpers."""
