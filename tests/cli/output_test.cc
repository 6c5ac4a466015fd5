// The CLI's listings: the same rows as a table, CSV and JSON, byte counts in the asked unit.
#include <gtest/gtest.h>

#include "output.h"

namespace ibnbd::cli {
namespace {

Listing sample() {
  return Listing{{{"name"}, {"size", true}, {"paths", true}},
                 {{"vol-a", Bytes{1536}, int64_t{2}}, {"b,with \"comma\"", Bytes{3ull << 30}, int64_t{10}}}};
}

TEST(CliOutput, UnitsAreBinaryAndAutoPicksTheLargestWholeOne) {
  EXPECT_EQ(format_bytes(0, Unit::automatic), "0B");
  EXPECT_EQ(format_bytes(1023, Unit::automatic), "1023B");
  EXPECT_EQ(format_bytes(1536, Unit::automatic), "1.5K");
  EXPECT_EQ(format_bytes(3ull << 30, Unit::automatic), "3.0G");
  EXPECT_EQ(format_bytes(3ull << 30, Unit::M), "3072.0M");
  EXPECT_EQ(format_bytes(5, Unit::B), "5B");
  EXPECT_FALSE(parse_unit("X").has_value());
  EXPECT_EQ(parse_unit("auto"), Unit::automatic);
}

TEST(CliOutput, TableAlignsColumnsAndNumbersRight) {
  EXPECT_EQ(render(sample(), {}),
            "name            size  paths\n"
            "vol-a           1.5K      2\n"
            "b,with \"comma\"  3.0G     10\n");
  OutputOptions o;
  o.headers = false;
  o.unit = Unit::K;
  EXPECT_EQ(render(sample(), o), "vol-a                 1.5K   2\n"
                                 "b,with \"comma\"  3145728.0K  10\n");
}

TEST(CliOutput, CsvQuotesWhatNeedsIt) {
  OutputOptions o;
  o.format = Format::csv;
  EXPECT_EQ(render(sample(), o), "name,size,paths\nvol-a,1.5K,2\n\"b,with \"\"comma\"\"\",3.0G,10\n");
}

TEST(CliOutput, JsonKeepsRawNumbers) {
  OutputOptions o;
  o.format = Format::json;
  auto j = nlohmann::json::parse(render(sample(), o));
  ASSERT_EQ(j.size(), 2u);
  EXPECT_EQ(j[0]["name"], "vol-a");
  EXPECT_EQ(j[0]["size"], 1536);
  EXPECT_EQ(j[1]["paths"], 10);
}

}  // namespace
}  // namespace ibnbd::cli
