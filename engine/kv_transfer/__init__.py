"""The KV connector API the engine calls: the connector base class and its
types (``base``), the params a prefill leg hands a decode leg (``params``),
the typed-options base (``options``), and connectors by name
(``registry``). The implementations live in ``connectors/``, above the
engine, and import these; the engine never imports them."""
