"""Typed wire messages, one module per channel of the service tree.

    front end --scheduler_input--> scheduler --detokenizer_input--> detokenizer
              <------------------------frontend_input---------------------------

Every message is a `msgspec.Struct` (tagged, keyword-only) encoded with msgpack; nothing on
these sockets is ever pickled. `sampling` holds the types that several channels share.
"""
