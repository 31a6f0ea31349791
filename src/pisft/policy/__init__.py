"""pisft.policy: the inference wing under evaluation and serving.

- `predictor`: a loaded pi0.5 with its processors, seeded noise (`ChunkPredictor`);
- `observations`, `libero`: openpi LIBERO requests checked and converted, answered by
  `LiberoPolicy`;
- `interface`: the one policy protocol both front ends use;
- `batching`: the one batching rule (who joins a forward, how long a batch is held, each
  request's own noise, the failure rule);
- `replicas`: its thread front end (one replica per accelerator; the closed loop, the
  collection). Its asyncio front end is `pisft.serve.policy_server`.
"""
