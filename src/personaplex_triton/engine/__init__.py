"""The slot engine, model-agnostic: conversations, the background loop, ticks, the outbox and
answers. It imports only core (not lm or mimi: a stage hands it its tick)."""
