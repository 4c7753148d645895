// The tiny-checkpoint writer of tests/unit/format, compiled into test_quantize too.
#include "../format/fixture_util.cpp"  // NOLINT(bugprone-suspicious-include)
