"""The go/no-go gates (`smoke_1card`, `smoke_value`): a few steps on one device before a training
stage takes every device. They sit above what they gate (training, the value model) and the
memory estimate their report carries (`pisft.introspect`)."""
