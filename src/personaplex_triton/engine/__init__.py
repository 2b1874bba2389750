"""The slot engine both stages run on: conversations mapped to slots, the background loop, its
ticks (a stage's batched step), the outbox and answers. It may import lm, mimi and core."""
