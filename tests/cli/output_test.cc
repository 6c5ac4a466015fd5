// The CLI's listings: the same rows as a table, CSV and JSON, byte counts in the asked unit.
#include <gtest/gtest.h>

#include "control/output.h"

namespace ibnbd::control {
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
  // Case: a small value in a large explicit unit. Expect: not "0.0G"; csv's exact form to the byte.
  EXPECT_EQ(format_bytes(64ull << 20, Unit::G), "0.062G");
  EXPECT_EQ(format_bytes(1048704, Unit::G), "0.00098G");
  EXPECT_EQ(format_bytes(0, Unit::G), "0.0G");
  EXPECT_EQ(format_bytes(64ull << 20, Unit::G, true), "0.0625G");
  EXPECT_EQ(format_bytes(1048704, Unit::M, true), "1.0001220703125M");
  EXPECT_EQ(format_bytes(3ull << 30, Unit::G, true), "3G");
  EXPECT_EQ(format_bytes(1, Unit::E, true), "8.6736173798840355e-19E");
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
  EXPECT_EQ(render(sample(), o), "name,size,paths\nvol-a,1.5K,2\n\"b,with \"\"comma\"\"\",3G,10\n");
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

TEST(CliOutput, ListCellsAreArraysInJsonAndWordsElsewhere) {
  // Case: a row with several URIs. Expect: a JSON array; space-separated in table and csv.
  Listing l{{{"device"}, {"uris"}}, {{Cell("a.img"), Cell(std::vector<std::string>{"nbd+unix:///a", "nbd://h:1/a"})}}};
  OutputOptions o;
  o.format = Format::json;
  EXPECT_EQ(nlohmann::json::parse(render(l, o))[0]["uris"], nlohmann::json::array({"nbd+unix:///a", "nbd://h:1/a"}));
  o.format = Format::csv;
  o.headers = false;
  EXPECT_EQ(render(l, o), "a.img,nbd+unix:///a nbd://h:1/a\n");
}

TEST(CliOutput, FieldSelectionAsRnbdHasIt) {
  std::string why;
  // Case: "size,name". Expect: exactly those columns, in the asked order.
  auto l = select_fields(sample(), "size,name", &why);
  ASSERT_TRUE(l) << why;
  ASSERT_EQ(l->columns.size(), 2u);
  EXPECT_EQ(l->columns[0].name, "size");
  EXPECT_EQ(l->rows[1][1].s, "b,with \"comma\"");
  // Case: "-size". Expect: the default set without it, default order.
  l = select_fields(sample(), "-size", &why);
  ASSERT_TRUE(l);
  ASSERT_EQ(l->columns.size(), 2u);
  EXPECT_EQ(l->columns[0].name, "name");
  EXPECT_EQ(l->columns[1].name, "paths");
  // Case: "-size,+size". Expect: back in its default place.
  l = select_fields(sample(), "-size,+size", &why);
  ASSERT_TRUE(l);
  EXPECT_EQ(l->columns[1].name, "size");
  // Case: "all" and "". Expect: everything.
  EXPECT_EQ(select_fields(sample(), "all", &why)->columns.size(), 3u);
  EXPECT_EQ(select_fields(sample(), "", &why)->columns.size(), 3u);
  // Case: a field the listing has not. Expect: refused, naming it and the fields there are.
  EXPECT_FALSE(select_fields(sample(), "name,bogus", &why));
  EXPECT_EQ(why, "unknown field bogus (fields: name size paths)");
  // Case: what a command line takes for a spec. Expect: a comma, a sign or "all"; names are not.
  EXPECT_TRUE(is_field_spec("a,b"));
  EXPECT_TRUE(is_field_spec("-rx_bytes"));
  EXPECT_TRUE(is_field_spec("all"));
  EXPECT_FALSE(is_field_spec("vol1.img"));
  EXPECT_FALSE(is_field_spec(""));
}

}  // namespace
}  // namespace ibnbd::control
